-- fail.lua: store a final error of the operation holding the lease (machine.fail).
-- KEYS[1]  the record
-- ARGV[1]  fencing token
-- ARGV[2]  error bytes
-- ARGV[3]  ttl of the failed record, milliseconds
-- ARGV[4]  the call's id (a re-sent call that finds it already applied answers 1)
-- returns  1 | 0 (lease lost) | {"corrupt", reason}
return finish("failed", KEYS[1], ARGV)
