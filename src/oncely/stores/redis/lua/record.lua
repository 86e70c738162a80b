-- record.lua: helpers shared by every script; _scripts.py prepends this file to each of them.
-- A transition's file reads KEYS[1] and ARGV only: batch.lua runs it once per item of a batch,
-- with KEYS and ARGV rebound to that item's (see _scripts.sources).
-- One record is one hash, KEYS[1] = "<prefix>{<namespace>:<key>}" (one cluster slot), with the
-- fields below. Times are epoch milliseconds of the server clock; the hash expires (PEXPIREAT)
-- exactly when its "expires" field says, so Redis itself purges expired records. An in-progress
-- record outlives its lease (see kept_until), so its tokens survive a worker whose lease lapsed.
--   status   in_progress | completed | failed | released
--   fp       fingerprint
--   token    fencing token; only grows while the hash exists
--   attempt  executions started for this record
--   lease    end of the current lease
--   expires  end of the record
--   created  first claim     updated  last change
--   op       the id of the call that last wrote the record (a claim's, suffixed "+" for a
--            takeover): a call re-sent after its reply was lost (redis-py retries a command
--            after a connection error or, on a cluster, a timeout) finds its own effect and
--            answers as the first run did (absent in records of older versions)
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

-- The fields of a record as load reads them ("op" stays out of replies: see as_reply); "result"
-- last, as it may be megabytes.
local FIELDS = {"status", "fp", "token", "attempt", "lease", "expires", "created", "updated",
                "op", "result"}

-- Returns the record at `key` as a table (with its result only if `with_result`: see FIELDS),
-- nil when absent, or nil and the reason the record is corrupt. One HMGET in the common case:
-- a foreign value is its WRONGTYPE error, and only a hash without a status needs EXISTS.
local function load(key, with_result)
  local v = redis.pcall("HMGET", key, unpack(FIELDS, 1, with_result and 10 or 9))
  if v.err then
    if string.sub(v.err, 1, 9) ~= "WRONGTYPE" then error(v) end
    return nil, "a " .. redis.call("TYPE", key)["ok"] .. " is stored at the key, not a hash"
  end
  if not v[1] and redis.call("EXISTS", key) == 0 then return nil end
  local r = {status = v[1], fp = v[2], token = v[3], attempt = v[4], lease = v[5],
             expires = v[6], created = v[7], updated = v[8], op = v[9], result = v[10]}
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

-- Whether record `r` shows that the call `op` already settled it to `status` with `token` (at
-- `now`): the same call, re-sent after its reply was lost, then answers 1 as the first did.
local function settled_by(r, op, status, token, now)
  return r ~= nil and now < r.expires and r.status == status and r.token == token and r.op == op
end

-- The expiry of an in-progress record whose lease ends at `lease`: `margin` milliseconds past
-- it (max(ttl, lease) for a claim; extend keeps the margin the record had), so the record, and
-- with it the token, outlives a worker whose lease lapsed (oncely._core.machine._kept_until).
local function kept_until(lease, margin)
  return lease + margin
end

-- complete and fail: store the outcome if argv[1] (token) still holds the lease of the record
-- at `key`. argv[2] outcome bytes, argv[3] ttl in milliseconds, argv[4] the call's id. Returns
-- 1 (also when this call already did it), 0 (lease lost) or corrupt.
local function finish(status, key, argv)
  local r, problem = load(key, false)
  if problem then return {"corrupt", problem} end
  local now = now_ms()
  local token = tonumber(argv[1])
  if not held(r, token, now) then
    if settled_by(r, argv[4], status, token, now) then return 1 end
    return 0
  end
  local expires = now + tonumber(argv[3])
  redis.call("HSET", key, "status", status, "result", argv[2], "lease", int(now),
             "expires", int(expires), "updated", int(now), "op", argv[4])
  redis.call("PEXPIREAT", key, int(expires))
  return 1
end
