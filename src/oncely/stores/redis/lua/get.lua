-- get.lua: read the record at KEYS[1] if it is live by the server clock.
-- KEYS[1]  the record hash
-- returns  {"record", status, fp, token, attempt, lease, expires, created, updated, result}
--          | {"absent"} | {"corrupt", reason}
local r, problem = load(KEYS[1], true)
if problem then return {"corrupt", problem} end
if r == nil or now_ms() >= r.expires then return {"absent"} end
return {"record", unpack(as_reply(r))}
