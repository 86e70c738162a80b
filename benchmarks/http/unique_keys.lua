-- wrk script: every request is a POST /payments with an Idempotency-Key no other request uses.
-- wrk -s unique_keys.lua ... -- <run prefix>
local threads = 0

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

function init(args)
  prefix = args[1] or "run"
  counter = 0
  body = '{"amount":500,"currency":"EUR"}'
end

function request()
  counter = counter + 1
  local headers = {}
  headers["Content-Type"] = "application/json"
  headers["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. counter
  return wrk.format("POST", "/payments", headers, body)
end
