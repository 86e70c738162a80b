-- get.lua: read the record at KEYS[1] if it is live by the server clock.
-- KEYS[1]  the record
-- returns  {"record", the record packed (see record.lua)} | {"absent"} | {"corrupt", reason}
local r, problem = load(KEYS[1])
if problem then return {"corrupt", problem} end
if r == nil or now_ms() >= r.expires then return {"absent"} end
return {"record", as_reply(r)}
