-- claim.lua: take the record at KEYS[1] for one worker, atomically, judged by the server clock.
-- Mirrors oncely._core.machine.claim row for row.
-- KEYS[1]  the record hash, "<prefix>{<namespace>:<key>}"
-- ARGV[1]  fingerprint
-- ARGV[2]  lease, milliseconds
-- ARGV[3]  ttl of an in-progress record, milliseconds (it outlives its lease: tokens survive)
-- returns  {"acquired", token, attempt, recovered (0|1)}
--          | {"in_progress", milliseconds left on the lease}
--          | {"replay", now, status, fp, token, attempt, lease, expires, created, updated, result}
--          | {"mismatch", stored fingerprint}
--          | {"corrupt", reason}
local r, problem = load(KEYS[1], true)
if problem then return {"corrupt", problem} end
local now = now_ms()
local fp, lease_ms, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

if r == nil or now >= r.expires or r.status == "released" then
  local token, attempt, created = 1, 1, now
  if r ~= nil then
    token = r.token + 1
    if now < r.expires then
      -- A released tombstone: the same operation is being retried.
      attempt = r.attempt + 1
      created = r.created
    end
  end
  local expires = math.max(now + ttl_ms, now + lease_ms)
  -- Writes start with HSET: if maxmemory refuses it, nothing has changed.
  redis.call("HSET", KEYS[1], "status", "in_progress", "fp", fp, "token", int(token),
             "attempt", int(attempt), "lease", int(now + lease_ms), "expires", int(expires),
             "created", int(created), "updated", int(now))
  if r ~= nil then redis.call("HDEL", KEYS[1], "result") end  -- left by an expired record
  redis.call("PEXPIREAT", KEYS[1], int(expires))
  return {"acquired", token, attempt, 0}
end
if r.fp ~= fp then return {"mismatch", r.fp} end
if r.status ~= "in_progress" then return {"replay", int(now), unpack(as_reply(r))} end
if now < r.lease then return {"in_progress", r.lease - now} end

-- The lease expired without being settled: take it over with the next token.
local lease = now + lease_ms
local expires = math.max(r.expires, lease)
redis.call("HSET", KEYS[1], "token", int(r.token + 1), "attempt", int(r.attempt + 1),
           "lease", int(lease), "expires", int(expires), "updated", int(now))
redis.call("PEXPIREAT", KEYS[1], int(expires))
return {"acquired", r.token + 1, r.attempt + 1, 1}
