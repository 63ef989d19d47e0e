-- complete.lua: file one completion call (a fused call's answers, and what was answered without a call
-- in the same loop iteration) in one round trip: wire version 2 (docs/wire-format.md, accounting.md).
--
-- Runs after lease.lua. When a lease token is given, the script first checks that this process still
-- holds the worker's lease (or takes it back if it lapsed and nobody took it since); a fenced process
-- gets the error DGRFENCED and nothing is written. Then the call guard: KEYS[7] holds '<epoch> <seq>' of
-- the last call filed; a call of the same epoch with a sequence not above it is a completion re-sent
-- after a reconnect whose first send ran: nothing is written again ('DUP').
--
-- Each record (one per result stream) holds the answers as columns (row i = one answer). Per row:
--   * once only: an ok row by its session's tally entry (published when its (attempt, position) is
--     above the last ok answer published for the session, or inside a gap), a row that is not ok by
--     `SET NX` of its result id's marker (`res` key). A row that is not fresh is neither published nor
--     charged: its index goes to the charges' `d` list;
--   * charged (rows with a billing account): prompt positions fed (`fed`, the positions pos - fed ..
--     pos - 1) at or above the session's charged high-water mark `hw` or owed (below), the rest
--     recomputed; a sampled token at position pos >= hw or owed; then hw moves past them. So every
--     prompt position and every sampled token is charged once per session, however often it is
--     replayed, re-sent or redelivered;
--     Of the prompt positions charged, those restored from the prefix cache (`kc`) are also counted as
--     cached (a part of the prompt's, never charged twice either);
--   * counted: tally deltas (prompt, gen, recomp, steps, engine seconds), account sums, worker sums.
-- A charged row (one with a billing account) of a session the Tracker moved off this worker (KEYS[8]: session id -> the attempt moved away, when
-- it declared this worker lost) is fenced if its attempt is that one or older: neither published nor
-- charged, so a worker that was only paused charges nothing the session's new worker charges again.
-- The record is XADDed with its charges (`c`, built here: what a reader sees charged is what was
-- charged) unless no row of it is fresh. Then the acks (one XACK per input stream), input blobs to
-- delete, closures (a closed session's tally entry is folded into its session hash and removed),
-- dead letters, and the fused call's counters.
--
-- Tally entry (one field per session of KEYS[6]): att, pub, hw, prompt, gen, recomp, steps, es, t, gaps,
-- account, owed, packed with Redis' struct library as TALLY (schemas/accounting.py names the layout and
-- reads it; binary because this script decodes and re-encodes every session of every call, and JSON
-- cost twice as much). A new entry starts from the session hash (a session closed and opened again: a
-- route's replay; or a late answer) or empty.
-- Every key comes in KEYS; no key name is built here (Redis Cluster: one hash tag).
--
-- KEYS[1] worker hash, [2] billing accounts index set, [3] dead-letter stream, [4] lease, [5] lease
-- epoch, [6] tally, [7] call guard, [8] moved, [9..] the other keys, each once, referred to by index.
-- The layout is named once in Python (consumer/transport/publish.py: COMPLETE_ARGV); tests/test_lua.py
-- checks it against the lines below.
-- ARGV[1] group, [2] result_ttl_s, [3] result_maxlen, [4] dlq_maxlen, [5] reject_ttl_s,
-- [6] lease_token ('' : no lease check), [7] lease_epoch, [8] lease_ms, [9] act_ttl_s, [10] call_seq,
-- [11] control (JSON, below), then the records, their rows, blob bytes and dead letters the control
-- refers to by ARGV index.
-- control: {"records": [{"out": K, "r": A of the record (published as is), "c": A of its rows' columns the
--            script reads (JSON: sid, st, att, pos, frm, fed, tok, es, and kc: positions of fed restored
--            from the prefix cache, only when a row has any; st, att, fed, es: one value when every row's is
--            the same), "acct": [n per row],
--            "skey": [K per row], "res": {"row": K}, "blob": {"row": [K, A]}}],
--           "accounts": [[K, "account id"], ...]  (acct number n >= 1 is accounts[n]; 0: none),
--           "acks": [[K, ["entry id", ...]], ...], "del": [K, ...],
--           "close": [["session id", K of its hash, "finished"|"cancelled"|"failed", acct n], ...],
--           "dead": A of the first dead letter (0: none), "nd": count,
--           "call": ["phase", sessions, rows, "engine seconds"] or absent}
-- Dead letter (3 + 2*nf ARGV): stream_k ('0': the cancel stream), entry_id, nf, then nf field/value pairs.
-- Returns: 'DUP', or the charges JSON of every record, in order.

local unpack = unpack or table.unpack
local group = ARGV[1]
local ttl = tonumber(ARGV[2])
local rmax = ARGV[3]
local dmax = ARGV[4]
local rttl = tonumber(ARGV[5])
local act_ttl = ARGV[9]
local now = tonumber(redis.call('TIME')[1])  -- the server's clock: one clock for every worker and the reaper
local ctl = cjson.decode(ARGV[11])
local worker, index, dlq, tally = KEYS[1], KEYS[2], KEYS[3], KEYS[6]

if ARGV[6] ~= '' and not hold_lease(KEYS[4], KEYS[5], ARGV[6], ARGV[7], ARGV[8]) then
  return redis.error_reply('DGRFENCED the lease of this worker is held by ' .. tostring(redis.call('GET', KEYS[4])))
end

-- The call guard (only with a lease: the epoch names this process).
if ARGV[6] ~= '' then
  local last = redis.call('GET', KEYS[7])
  if last then
    local e, q = string.match(last, '^(%d+) (%d+)$')
    if e == ARGV[7] and tonumber(q) >= tonumber(ARGV[10]) then
      return 'DUP'
    end
  end
  redis.call('SET', KEYS[7], ARGV[7] .. ' ' .. ARGV[10])
end

local function fmt(x)
  return string.format('%.17g', x)
end

local function int(x)
  return string.format('%d', x)
end

-- Stream id a is above stream id b ('ms-seq').
local function id_above(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if am == nil then return false end
  if bm == nil then return true end
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end

local function expire_at_least(key, secs)
  if redis.call('TTL', key) < secs then
    redis.call('EXPIRE', key, secs)
  end
end
