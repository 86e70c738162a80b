-- record.lua: helpers shared by every transition; _scripts.py puts this file first, then each
-- transition's file as the body of `local function <name>(KEYS, ARGV)` (which reads KEYS[1] and
-- ARGV only: batch.lua runs it once per item of a batch, with that item's KEYS and ARGV). Loaded
-- as one function library (FUNCTION LOAD, then FCALL), this file runs once per load; as a script
-- (EVALSHA, on servers without functions), once per call.
-- One record is one string, KEYS[1] = "<prefix>{<namespace>:<key>}" (one cluster slot), packed
-- in a fixed layout (struct format HEAD, big-endian; _codec.HEAD reads the same):
--   version  1 byte, 1
--   status   1 byte: 1 in_progress, 2 completed, 3 failed, 4 released
--   token    8 bytes, fencing token; only grows while the record exists
--   attempt  4 bytes, executions started for this record
--   lease    8 bytes, end of the current lease
--   expires  8 bytes, end of the record
--   created  8 bytes, first claim          updated  8 bytes, last change
--   then the lengths of fp and op (4 bytes each), then fp (the fingerprint), op (the id of the
--   call that last wrote the record: a claim's, suffixed "+" for a takeover, so that a call
--   re-sent after its reply was lost finds its own effect and answers as the first run did),
--   and last the result (completed and failed records only: the rest of the string).
-- Times are epoch milliseconds of the server clock; the key expires (PXAT) exactly when its
-- "expires" says, so Redis itself purges expired records. An in-progress record outlives its
-- lease (see kept_until), so its tokens survive a worker whose lease lapsed. One GET reads a
-- record and one SET writes it: every redis.call costs a script a few µs of dispatch.
-- Records of oncely versions before the packed layout are hashes with one field each; load
-- reads them too (load_hash), and the next write replaces them by the packed string.

-- Makes no table, only the closures below: a script runs this file on every call.
local HEAD = ">BBi8I4i8i8i8i8I4I4"
local HEAD_LEN = 54

-- The server's clock, in milliseconds: the only clock that judges leases and expiry. Read once
-- per call (each entry point of the library forgets it first, see _scripts.library): the items
-- of a batch are judged at one instant, in their order.
local clock
local function now_ms()
  if clock == nil then
    local t = redis.call("TIME")
    -- Arithmetic reads a string as a number (as tonumber does, at half the cost); so do the
    -- transitions with the numbers of their ARGV.
    local us = t[2] + 0
    clock = t[1] * 1000 + (us - us % 1000) / 1000
  end
  return clock
end

-- A number as an integer string: cheaper than a number argument to redis.call, which Redis
-- writes with snprintf("%.17g"); tostring would switch to exponent notation past 14 digits.
local function int(n)
  return string.format("%d", n)
end

-- The status of code `code` in a packed record (nil for an unknown code), and the code of a
-- status (a chain of comparisons: a table would be made again on every run).
local function status_of(code)
  return code == 1 and "in_progress" or code == 2 and "completed" or code == 3 and "failed"
    or code == 4 and "released" or nil
end
local function code_of(status)
  return status == "in_progress" and 1 or status == "completed" and 2 or status == "failed" and 3
    or status == "released" and 4 or nil
end

-- A record of the hash layout of earlier versions (see the header), or nil and the reason it is
-- corrupt. Its result is kept as "result".
local function load_hash(key)
  local v = redis.call("HMGET", key, "status", "fp", "token", "attempt", "lease", "expires",
                       "created", "updated", "op", "result")
  local r = {status = v[1], fp = v[2], token = v[3], attempt = v[4], lease = v[5],
             expires = v[6], created = v[7], updated = v[8], op = v[9] or "", result = v[10]}
  if not code_of(r.status) then return nil, "unknown status " .. tostring(r.status) end
  if type(r.fp) ~= "string" then return nil, "no fingerprint" end
  for _, name in ipairs({"token", "attempt", "lease", "expires", "created", "updated"}) do
    local text = r[name]
    if type(text) ~= "string" or not string.match(text, "^%-?%d+$") then
      return nil, "field " .. name .. " is not an integer: " .. tostring(text)
    end
    r[name] = tonumber(text)
  end
  return r
end

-- Returns the record at `key` as a table, nil when absent, or nil and the reason the record is
-- corrupt. `r.packed` is the stored string, `r.rest` where its result starts (a record of the
-- hash layout has `r.result` instead); its op is read when needed (op_of). One GET in the common case: a foreign value is its
-- WRONGTYPE error, and only then does TYPE tell a hash of the earlier layout from the rest.
local function load(key)
  local v = redis.pcall("GET", key)
  if not v then return nil end
  if type(v) == "table" then
    if string.sub(v.err, 1, 9) ~= "WRONGTYPE" then error(v) end
    local kind = redis.call("TYPE", key)["ok"]
    if kind == "hash" then return load_hash(key) end
    return nil, "a " .. kind .. " is stored at the key, not a record"
  end
  local version, code, token, attempt, lease, expires, created, updated, nfp, nop, at
  if #v >= HEAD_LEN then
    version, code, token, attempt, lease, expires, created, updated, nfp, nop, at =
      struct.unpack(HEAD, v)
  end
  if version ~= 1 then return nil, "not an oncely record (" .. #v .. " bytes)" end
  local status = status_of(code)
  if status == nil then return nil, "unknown status " .. code end
  if #v < HEAD_LEN + nfp + nop then return nil, "truncated record (" .. #v .. " bytes)" end
  return {status = status, token = token, attempt = attempt, lease = lease, expires = expires,
          created = created, updated = updated, fp = string.sub(v, at, at + nfp - 1),
          nop = nop, packed = v, rest = at + nfp + nop}
end

-- The id of the call that last wrote record `r`: a string.sub of the packed record, the first
-- time it is needed (most calls never need it).
local function op_of(r)
  if r.op == nil then r.op = string.sub(r.packed, r.rest - r.nop, r.rest - 1) end
  return r.op
end

-- Record `r` packed as it is stored, with `result` (nil for none) after its fields.
local function pack(r, result)
  local op = op_of(r)
  return struct.pack(HEAD, 1, code_of(r.status), r.token, r.attempt, r.lease, r.expires,
                     r.created, r.updated, #r.fp, #op) .. r.fp .. op .. (result or "")
end

-- Record `r`, loaded with its result, as one reply: the packed string (a record of the hash
-- layout packed now), which _codec.record decodes.
local function as_reply(r)
  return r.packed or pack(r, r.result)
end

-- Write record `r` (with `result`) at `key`, expiring when it does. One SET with PXAT (Redis
-- 6.2); a server that does not know PXAT answers a syntax error and gets SET then PEXPIREAT.
-- If maxmemory refuses the write, nothing has changed.
local function store(key, r, result)
  local value, at = pack(r, result), int(r.expires)
  local ok = redis.pcall("SET", key, value, "PXAT", at)
  if type(ok) == "table" and ok.err then
    if not string.find(ok.err, "syntax", 1, true) then error(ok) end
    redis.call("SET", key, value)
    redis.call("PEXPIREAT", key, at)
  end
end

-- Whether `token` holds the lease of record `r` at `now` (machine._held).
local function held(r, token, now)
  return r ~= nil and now < r.expires and r.status == "in_progress" and r.token == token
end

-- Whether record `r` shows that the call `op` already settled it to `status` with `token` (at
-- `now`): the same call, re-sent after its reply was lost, then answers 1 as the first did.
local function settled_by(r, op, status, token, now)
  return r ~= nil and now < r.expires and r.status == status and r.token == token
    and op_of(r) == op
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
  local r, problem = load(key)
  if problem then return {"corrupt", problem} end
  local now = now_ms()
  local token = argv[1] + 0
  if not held(r, token, now) then
    if settled_by(r, argv[4], status, token, now) then return 1 end
    return 0
  end
  r.status, r.lease, r.expires, r.updated, r.op = status, now, now + argv[3], now, argv[4]
  store(key, r, argv[2])
  return 1
end
