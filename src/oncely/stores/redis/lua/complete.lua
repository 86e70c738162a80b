-- complete.lua: store the result of the operation holding the lease (machine.complete).
-- KEYS[1]  the record
-- ARGV[1]  fencing token
-- ARGV[2]  result bytes
-- ARGV[3]  ttl of the completed record, milliseconds
-- ARGV[4]  the call's id (a re-sent call that finds it already applied answers 1)
-- returns  1 | 0 (lease lost) | {"corrupt", reason}
return finish("completed", KEYS[1], ARGV)
