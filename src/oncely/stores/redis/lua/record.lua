-- record.lua: helpers shared by every script; _scripts.py prepends this file to each of them.
-- A transition's file reads KEYS[1] and ARGV only: batch.lua runs it once per item of a batch,
-- with KEYS and ARGV rebound to that item's (see _scripts.sources).
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

-- The server's clock, in milliseconds: the only clock that judges leases and expiry. Read once
-- per script run: the items of a batch are judged at one instant, in their order.
local clock
local function now_ms()
  if clock == nil then
    local t = redis.call("TIME")
    clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return clock
end

-- A number as an integer string (tostring would switch to exponent notation past 14 digits).
local function int(n)
  return string.format("%d", n)
end

-- The fields of a record, in the order of every reply; "result" last, as it may be megabytes.
local FIELDS = {"status", "fp", "token", "attempt", "lease", "expires", "created", "updated",
                "result"}

-- Returns the record at `key` as a table (with its result only if `with_result`: see FIELDS),
-- nil when absent, or nil and the reason the record is corrupt. One HMGET in the common case:
-- a foreign value is its WRONGTYPE error, and only a hash without a status needs EXISTS.
local function load(key, with_result)
  local v = redis.pcall("HMGET", key, unpack(FIELDS, 1, with_result and 9 or 8))
  if v.err then
    if string.sub(v.err, 1, 9) ~= "WRONGTYPE" then error(v) end
    return nil, "a " .. redis.call("TYPE", key)["ok"] .. " is stored at the key, not a hash"
  end
  if not v[1] and redis.call("EXISTS", key) == 0 then return nil end
  local r = {status = v[1], fp = v[2], token = v[3], attempt = v[4], lease = v[5],
             expires = v[6], created = v[7], updated = v[8], result = v[9]}
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

-- Record `r`, loaded with its result, as a reply: the FIELDS in order (result false, a nil
-- reply, when there is none).
local function as_reply(r)
  return {r.status, r.fp, r.token, r.attempt, r.lease, r.expires, r.created, r.updated,
          r.result or false}
end

-- Whether `token` holds the lease of record `r` at `now` (machine._held).
local function held(r, token, now)
  return r ~= nil and now < r.expires and r.status == "in_progress" and r.token == token
end

-- complete and fail: store the outcome if argv[1] (token) still holds the lease of the record
-- at `key`. argv[2] outcome bytes, argv[3] ttl in milliseconds. Returns 1, 0 (lease lost) or
-- corrupt.
local function finish(status, key, argv)
  local r, problem = load(key, false)
  if problem then return {"corrupt", problem} end
  local now = now_ms()
  if not held(r, tonumber(argv[1]), now) then return 0 end
  local expires = now + tonumber(argv[3])
  redis.call("HSET", key, "status", status, "result", argv[2], "lease", int(now),
             "expires", int(expires), "updated", int(now))
  redis.call("PEXPIREAT", key, int(expires))
  return 1
end
