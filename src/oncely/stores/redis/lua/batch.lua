-- batch.lua: one transition for each item of a batch, in order: claim_many and complete_many.
-- _scripts.py makes this file the body of `local function claim_many(KEYS, ARGV)`, after
-- `local one = claim` (the transition's function, which reads its item's key and arguments),
-- and likewise for complete_many.
-- KEYS     the record hashes of the items, in order (one cluster slot: the caller groups them)
-- ARGV     the items' arguments, the same number for each item, item after item
-- returns  one reply per item, as the transition's script answers it alone, or
--          {"error", message} where the transition raised an error (a write the server refused):
--          that item failed and the batch goes on, as separate calls would
local width = #ARGV / #KEYS
local out = {}
for i = 1, #KEYS do
  local ok, reply = pcall(one, {KEYS[i]}, {unpack(ARGV, (i - 1) * width + 1, i * width)})
  if ok then
    out[i] = reply
  elseif type(reply) == "table" and reply.err then
    out[i] = {"error", reply.err}
  else
    out[i] = {"error", tostring(reply)}
  end
end
return out
