-- release.lua: give the lease up, leaving a tombstone that keeps the token (machine.release).
-- The record keeps its expiry, so the token outlives any worker that might still hold it.
-- KEYS[1]  the record hash
-- ARGV[1]  fencing token
-- returns  1 | 0 (lease lost) | {"corrupt", reason}
local r, problem = load(KEYS[1], false)
if problem then return {"corrupt", problem} end
local now = now_ms()
if not held(r, tonumber(ARGV[1]), now) then return 0 end
redis.call("HSET", KEYS[1], "status", "released", "lease", int(now), "updated", int(now))
return 1
