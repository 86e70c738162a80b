-- record.lua: helpers shared by every script; _scripts.py prepends this file to each of them.
-- One record is one hash, KEYS[1] = "<prefix>{<namespace>:<key>}" (one cluster slot), with the
-- fields below. Times are epoch milliseconds of the server clock; the hash expires (PEXPIREAT)
-- exactly when its "expires" field says, so Redis itself purges expired records.
--   status   in_progress | completed | failed | released
--   fp       fingerprint
--   token    fencing token; only grows while the hash exists
--   attempt  executions started for this record
--   lease    end of the current lease
--   expires  end of the record
--   created  first claim     updated  last change
--   result   the outcome (completed and failed records only)

-- Redis < 5 replicates scripts verbatim unless told to replicate their effects (TIME is not
-- deterministic); from 5 on this is the default and the call is a no-op.
if redis.replicate_commands then redis.replicate_commands() end

local STATUSES = {in_progress = true, completed = true, failed = true, released = true}
local NUMBERS = {"token", "attempt", "lease", "expires", "created", "updated"}

-- The server's clock, in milliseconds: the only clock that judges leases and expiry.
local function now_ms()
  local t = redis.call("TIME")
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A number as an integer string (tostring would switch to exponent notation past 14 digits).
local function int(n)
  return string.format("%d", n)
end

-- Returns the record at `key` as a table without its result (which may be megabytes: see
-- with_result), nil when absent, or nil and the reason the record is corrupt.
local function load(key)
  local kind = redis.call("TYPE", key)["ok"]
  if kind == "none" then return nil end
  if kind ~= "hash" then return nil, "a " .. kind .. " is stored at the key, not a hash" end
  local v = redis.call("HMGET", key, "status", "fp", "token", "attempt", "lease", "expires",
                       "created", "updated")
  local r = {status = v[1], fp = v[2], token = v[3], attempt = v[4], lease = v[5],
             expires = v[6], created = v[7], updated = v[8]}
  if not STATUSES[r.status] then return nil, "unknown status " .. tostring(r.status) end
  if type(r.fp) ~= "string" then return nil, "no fingerprint" end
  for _, name in ipairs(NUMBERS) do
    local text = r[name]
    if type(text) ~= "string" or not string.match(text, "^%-?%d+$") then
      return nil, "field " .. name .. " is not an integer: " .. tostring(text)
    end
    r[name] = tonumber(text)
  end
  return r
end

-- The record at `key` as a reply: status, fp, token, attempt, lease, expires, created, updated,
-- result (false, a nil reply, when there is none).
local function with_result(key, r)
  return {r.status, r.fp, r.token, r.attempt, r.lease, r.expires, r.created, r.updated,
          redis.call("HGET", key, "result")}
end

-- Whether `token` holds the lease of record `r` at `now` (machine._held).
local function held(r, token, now)
  return r ~= nil and now < r.expires and r.status == "in_progress" and r.token == token
end

-- complete and fail: store the outcome if ARGV[1] (token) still holds the lease.
-- ARGV[2] outcome bytes, ARGV[3] ttl in milliseconds. Returns 1, 0 (lease lost) or corrupt.
local function finish(status)
  local r, problem = load(KEYS[1])
  if problem then return {"corrupt", problem} end
  local now = now_ms()
  if not held(r, tonumber(ARGV[1]), now) then return 0 end
  local expires = now + tonumber(ARGV[3])
  redis.call("HSET", KEYS[1], "status", status, "result", ARGV[2], "lease", int(now),
             "expires", int(expires), "updated", int(now))
  redis.call("PEXPIREAT", KEYS[1], int(expires))
  return 1
end
