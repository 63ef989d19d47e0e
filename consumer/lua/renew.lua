-- renew.lua (after lease.lua): keep the lease, or say it is lost.
-- KEYS[1] lease, KEYS[2] epoch. ARGV[1] token, [2] epoch, [3] lease ms.
-- Returns 1 when this token still held the lease (extended by lease ms), 2 when it had lapsed and
-- nobody took it since (taken back), 0 when another process holds it.
local had = redis.call('GET', KEYS[1]) == ARGV[1]
if hold_lease(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  if had then
    return 1
  end
  return 2
end
return 0
