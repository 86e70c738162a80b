-- extend.lua: move the end of the lease to ARGV[2] from now (machine.extend).
-- KEYS[1]  the record
-- ARGV[1]  fencing token
-- ARGV[2]  lease, milliseconds
-- returns  1 | 0 (lease lost) | {"corrupt", reason}
-- Re-running it (a re-send after a lost reply) only moves the lease again: no call id needed.
-- The record keeps its margin past the lease's end (at least the new lease): see kept_until.
local r, problem = load(KEYS[1])
if problem then return {"corrupt", problem} end
local now = now_ms()
local lease_ms = ARGV[2] + 0
if not held(r, ARGV[1] + 0, now) then return 0 end
local lease = now + lease_ms
r.expires = math.max(r.expires, kept_until(lease, math.max(r.expires - r.lease, lease_ms)))
r.lease, r.updated = lease, now
store(KEYS[1], r)
return 1
