-- claim.lua: take the record at KEYS[1] for one worker, atomically, judged by the server clock.
-- Mirrors oncely._core.machine.claim row for row.
-- KEYS[1]  the record, "<prefix>{<namespace>:<key>}"
-- ARGV[1]  fingerprint
-- ARGV[2]  lease, milliseconds
-- ARGV[3]  how long an in-progress record is kept past the end of its lease, milliseconds:
--          max(ttl, lease), so the token outlives a worker whose lease lapsed
-- ARGV[4]  the call's id: a claim re-sent after its reply was lost finds its own lease and
--          answers as the first run did
-- returns  {"acquired", token, attempt, recovered (0|1)}
--          | {"in_progress", milliseconds left on the lease}
--          | {"replay", now, the record packed (see record.lua)}
--          | {"mismatch", stored fingerprint}
--          | {"corrupt", reason}
local r, problem = load(KEYS[1])
if problem then return {"corrupt", problem} end
local now = now_ms()
local fp, op = ARGV[1], ARGV[4]

if r ~= nil and r.status == "in_progress" and now < r.expires and r.fp == fp then
  -- This very call ran already: answer as it did.
  local last = op_of(r)
  if last == op then return {"acquired", r.token, r.attempt, 0} end
  if last == op .. "+" then return {"acquired", r.token, r.attempt, 1} end
end

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
  local lease = now + ARGV[2]
  store(KEYS[1], {status = "in_progress", fp = fp, token = token, attempt = attempt,
                  lease = lease, expires = kept_until(lease, ARGV[3] + 0), created = created,
                  updated = now, op = op})
  return {"acquired", token, attempt, 0}
end
if r.fp ~= fp then return {"mismatch", r.fp} end
if r.status ~= "in_progress" then return {"replay", now, as_reply(r)} end
if now < r.lease then return {"in_progress", r.lease - now} end

-- The lease expired without being settled: take it over with the next token.
r.token, r.attempt, r.lease, r.updated, r.op = r.token + 1, r.attempt + 1, now + ARGV[2], now,
                                               op .. "+"
r.expires = math.max(r.expires, kept_until(r.lease, ARGV[3] + 0))
store(KEYS[1], r)
return {"acquired", r.token, r.attempt, 1}
