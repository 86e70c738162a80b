-- extend.lua: move the end of the lease to ARGV[2] from now (machine.extend).
-- KEYS[1]  the record hash
-- ARGV[1]  fencing token
-- ARGV[2]  lease, milliseconds
-- returns  1 | 0 (lease lost) | {"corrupt", reason}
local r, problem = load(KEYS[1], false)
if problem then return {"corrupt", problem} end
local now = now_ms()
if not held(r, tonumber(ARGV[1]), now) then return 0 end
local lease = now + tonumber(ARGV[2])
local expires = math.max(r.expires, lease)
redis.call("HSET", KEYS[1], "lease", int(lease), "expires", int(expires), "updated", int(now))
redis.call("PEXPIREAT", KEYS[1], int(expires))
return 1
