-- forget.lua: make the next claim run the operation again. A finished record becomes a released
-- tombstone that keeps its token (and its expiry) and drops its result; an in-progress one only
-- with force, which ends its lease.
-- KEYS[1]  the record
-- ARGV[1]  "1" to forget an in-progress record too
-- returns  {"absent"} | {"refused"} | {"forgot", status} | {"corrupt", reason}
local r, problem = load(KEYS[1])
if problem then return {"corrupt", problem} end
local now = now_ms()
if r == nil or now >= r.expires or r.status == "released" then return {"absent"} end
if r.status == "in_progress" and ARGV[1] ~= "1" then return {"refused"} end
local status = r.status
r.status, r.lease, r.updated, r.op = "released", math.min(r.lease, now), now, ""
store(KEYS[1], r)
return {"forgot", status}
