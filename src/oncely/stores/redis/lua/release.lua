-- release.lua: give the lease up, leaving a tombstone that keeps the token (machine.release).
-- The record keeps its expiry, so the token outlives any worker that might still hold it.
-- KEYS[1]  the record
-- ARGV[1]  fencing token
-- ARGV[2]  the call's id (a re-sent call that finds it already applied answers 1)
-- returns  1 | 0 (lease lost) | {"corrupt", reason}
local r, problem = load(KEYS[1])
if problem then return {"corrupt", problem} end
local now = now_ms()
local token = ARGV[1] + 0
if not held(r, token, now) then
  if settled_by(r, ARGV[2], "released", token, now) then return 1 end
  return 0
end
r.status, r.lease, r.updated, r.op = "released", now, now, ARGV[2]
store(KEYS[1], r)
return 1
