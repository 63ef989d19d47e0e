-- complete.lua: answer a batch of step jobs in one round trip (see consumer/transport.py).
--
-- Runs after lease.lua. When a lease token is given, the script first checks that this process
-- still holds the worker's lease (or takes it back if it lapsed and nobody took it since); a fenced
-- process gets the error DGRFENCED and nothing is written.
--
-- The job id decides, not the delivery: for each completion, XACK the entry, then SET the result
-- record NX EX; only when that SET succeeded (this job id was never answered, or Redis lost the
-- answer together with everything else the answering call wrote): XADD the result to the session's
-- result stream (MAXLEN ~), EXPIRE it, and count the accounting (session and billing account when
-- the account is known, worker always). So a completion re-sent after a reconnect, a second delivery
-- of the same entry, or a second entry carrying an answered job id changes nothing, and an entry whose
-- delivery record Redis lost (restart) still gets its one answer.
-- "XACK returned 1" below means: XACK returned 1 for this entry in this call, here or earlier in the
-- same call (the worker may answer one malformed delivery with a rejection AND a dead letter).
-- An answer with a billing account is one of a session this worker holds (or held): record and
-- result stream live `result ttl`, the session hash is counted and lives `result ttl` after its last
-- step. An answer without one (a session this worker does not hold: rejected before it opened,
-- state_lost, an undecodable entry) touches no session hash, its record lives `reject ttl`, and its
-- result stream lives at least `reject ttl` (a longer TTL is never shortened): so a flood of entries
-- naming made-up sessions leaves nothing behind once `reject ttl` has passed.
-- Route hops (docs/wire-format.md, "Activations"): a completion may name its job's input blob (deleted
-- whatever the answer: the job is answered, its rows are not needed again) and an output blob, SET with
-- its bytes EX act_ttl_s only together with the first answer (with the result record's SET NX), so the
-- result that names the blob and the blob appear at once, and a re-sent completion writes neither.
-- For each dead letter: XACK; only when it returned 1: XADD the dead-letter entry (MAXLEN ~). A dead
-- letter with stream index 0 is a cancellation entry (no consumer group, nothing to ack): it is
-- added only when its id is above the worker hash's `cancel_dead_letters_upto` (a restarted worker
-- re-reads the cancel stream and must not dead-letter the same entry twice), which it then moves.
-- If a fused-call record is given (and the batch is not a pure replay): per-worker call counters.
-- Recomputation (docs/accounting.md): a replayed prefill (attempt > 0) re-feeds positions this
-- session was already charged for; those (below the session's prompt + generated tokens so far)
-- count as recomputed_tokens, not prompt_tokens.
-- Every key comes in KEYS; no key name is built here.
--
-- KEYS[1] worker account hash, KEYS[2] billing accounts index set, KEYS[3] dead-letter stream,
-- KEYS[4] lease, KEYS[5] lease epoch, KEYS[6..] the other keys, each once, referred to from ARGV by index.
-- The layout is named once in Python (consumer/transport.py: COMPLETE_ARGV, COMPLETION_ARGV,
-- DEAD_LETTER_ARGV, FUSED_CALL_ARGV); tests/test_lua.py checks it against the lines below.
-- ARGV[1] group, [2] result_ttl_s, [3] result_maxlen, [4] dlq_maxlen,
-- [5] n_completions, [6] n_dead_letters, [7] has_call ('1' when a fused-call record follows),
-- [8] reject_ttl_s, [9] lease_token ('' : no lease check), [10] lease_epoch, [11] lease_ms,
-- [12] act_ttl_s.
-- Completion (20 + 2*nf): stream_k, entry_id, record_k, record_value, results_k, session_k,
--   account_k ('0' for none), account_id, status, phase, prompt_tokens, generated_tokens,
--   engine_seconds, close ('' for none), start (position), replay ('1' for a prefill of attempt > 0),
--   in_blob_k ('0' for none), out_blob_k ('0' for none), out_blob (its bytes),
--   nf, then nf field/value pairs.
-- Dead letter (3 + 2*nf): stream_k ('0': the cancel stream), entry_id, nf, then nf field/value pairs.
-- Fused call (4): phase, batch_size, tokens, engine_seconds.
-- Returns one integer per completion: 1 when it was the first to finish, else 0.

local unpack = unpack or table.unpack
local group = ARGV[1]
local ttl = ARGV[2]
local rmax = ARGV[3]
local dmax = ARGV[4]
local nc = tonumber(ARGV[5])
local nd = tonumber(ARGV[6])
local has_call = ARGV[7] == '1'
local rttl = ARGV[8]
local act_ttl = ARGV[12]
local worker, index, dlq = KEYS[1], KEYS[2], KEYS[3]

if ARGV[9] ~= '' and not hold_lease(KEYS[4], KEYS[5], ARGV[9], ARGV[10], ARGV[11]) then
  return redis.error_reply('DGRFENCED the lease of this worker is held by ' .. tostring(redis.call('GET', KEYS[4])))
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
  if redis.call('TTL', key) < tonumber(secs) then
    redis.call('EXPIRE', key, secs)
  end
end

local acked = {}
local function ack(k, stream, entry)
  local key = k .. ' ' .. entry
  local r = acked[key]
  if r == nil then
    r = redis.call('XACK', stream, group, entry) == 1
    acked[key] = r
  end
  return r
end

local out = {}
local any_first = false
local w_prompt, w_generated, w_recomputed, w_steps, w_share = 0, 0, 0, 0, 0.0
local by_status, by_phase = {}, {}
local accounts, account_order = {}, {}
local i = 13
for c = 1, nc do
  local sk = ARGV[i]
  local stream = KEYS[tonumber(sk)]
  local entry = ARGV[i + 1]
  local record = KEYS[tonumber(ARGV[i + 2])]
  local value = ARGV[i + 3]
  local results = KEYS[tonumber(ARGV[i + 4])]
  local session = KEYS[tonumber(ARGV[i + 5])]
  local ak = tonumber(ARGV[i + 6])
  local account_id = ARGV[i + 7]
  local status = ARGV[i + 8]
  local phase = ARGV[i + 9]
  local prompt = tonumber(ARGV[i + 10])
  local generated = tonumber(ARGV[i + 11])
  local secs = ARGV[i + 12]
  local close = ARGV[i + 13]
  local start = tonumber(ARGV[i + 14])
  local replay = ARGV[i + 15] == '1'
  local in_blob = tonumber(ARGV[i + 16])
  local out_blob = tonumber(ARGV[i + 17])
  local nf = tonumber(ARGV[i + 19])
  local first = 0
  ack(sk, stream, entry)
  if in_blob > 0 then
    redis.call('DEL', KEYS[in_blob])
  end
  if redis.call('SET', record, value, 'NX', 'EX', ak > 0 and ttl or rttl) then
    first = 1
    any_first = true
    if out_blob > 0 then
      redis.call('SET', KEYS[out_blob], ARGV[i + 18], 'EX', act_ttl)
    end
    if nf > 0 then
      redis.call('XADD', results, 'MAXLEN', '~', rmax, '*', unpack(ARGV, i + 20, i + 19 + 2 * nf))
      if ak > 0 then
        redis.call('EXPIRE', results, ttl)
      else
        expire_at_least(results, rttl)
      end
    end
    local recomputed = 0
    if ak > 0 then
      if replay and prompt > 0 then
        local done = (tonumber(redis.call('HGET', session, 'prompt_tokens')) or 0)
                     + (tonumber(redis.call('HGET', session, 'generated_tokens')) or 0)
        recomputed = math.max(0, math.min(prompt, done - start))
        prompt = prompt - recomputed
      end
      redis.call('HINCRBY', session, 'prompt_tokens', int(prompt))
      redis.call('HINCRBY', session, 'generated_tokens', int(generated))
      if recomputed > 0 then
        redis.call('HINCRBY', session, 'recomputed_tokens', int(recomputed))
      end
      redis.call('HINCRBY', session, 'steps', 1)
      redis.call('HINCRBYFLOAT', session, 'engine_seconds', secs)
      if close ~= '' then
        redis.call('HSET', session, 'account', account_id, 'closed', close)
      else
        redis.call('HSET', session, 'account', account_id)
      end
      redis.call('EXPIRE', session, ttl)
      local a = accounts[ak]
      if a == nil then
        a = {id = account_id, prompt = 0, generated = 0, recomputed = 0, steps = 0, secs = 0.0}
        accounts[ak] = a
        account_order[#account_order + 1] = ak
      end
      a.prompt = a.prompt + prompt
      a.generated = a.generated + generated
      a.recomputed = a.recomputed + recomputed
      a.steps = a.steps + 1
      a.secs = a.secs + tonumber(secs)
    elseif close ~= '' and redis.call('EXISTS', session) == 1 then
      redis.call('HSETNX', session, 'closed', close)  -- no account: close what exists, create nothing
    end
    w_prompt = w_prompt + prompt
    w_generated = w_generated + generated
    w_recomputed = w_recomputed + recomputed
    w_steps = w_steps + 1
    w_share = w_share + tonumber(secs)
    by_status[status] = (by_status[status] or 0) + 1
    by_phase[phase] = (by_phase[phase] or 0) + 1
  end
  out[c] = first
  i = i + 20 + 2 * nf
end

for d = 1, nd do
  local sk = ARGV[i]
  local stream = sk ~= '0' and KEYS[tonumber(sk)] or nil
  local entry = ARGV[i + 1]
  local nf = tonumber(ARGV[i + 2])
  local fresh
  if sk == '0' then
    fresh = id_above(entry, redis.call('HGET', worker, 'cancel_dead_letters_upto') or '0-0')
    if fresh then redis.call('HSET', worker, 'cancel_dead_letters_upto', entry) end
  else
    fresh = ack(sk, stream, entry)
  end
  if fresh then
    redis.call('XADD', dlq, 'MAXLEN', '~', dmax, '*', unpack(ARGV, i + 3, i + 2 + 2 * nf))
    redis.call('HINCRBY', worker, 'dead_letters', 1)
  end
  i = i + 3 + 2 * nf
end

if w_steps > 0 then
  redis.call('HINCRBY', worker, 'steps', int(w_steps))
  redis.call('HINCRBY', worker, 'prompt_tokens', int(w_prompt))
  redis.call('HINCRBY', worker, 'generated_tokens', int(w_generated))
  if w_recomputed > 0 then
    redis.call('HINCRBY', worker, 'recomputed_tokens', int(w_recomputed))
  end
  redis.call('HINCRBYFLOAT', worker, 'engine_seconds_share', fmt(w_share))
  for status, n in pairs(by_status) do
    redis.call('HINCRBY', worker, 'results:' .. status, int(n))
  end
  for phase, n in pairs(by_phase) do
    redis.call('HINCRBY', worker, 'steps:' .. phase, int(n))
  end
  for _, ak in ipairs(account_order) do
    local a = accounts[ak]
    local key = KEYS[ak]
    redis.call('HINCRBY', key, 'prompt_tokens', int(a.prompt))
    redis.call('HINCRBY', key, 'generated_tokens', int(a.generated))
    redis.call('HINCRBY', key, 'steps', int(a.steps))
    if a.recomputed > 0 then
      redis.call('HINCRBY', key, 'recomputed_tokens', int(a.recomputed))
    end
    redis.call('HINCRBYFLOAT', key, 'engine_seconds', fmt(a.secs))
    redis.call('SADD', index, a.id)
  end
end

if has_call and (nc == 0 or any_first) then
  local phase = ARGV[i]
  redis.call('HINCRBY', worker, 'fused_calls', 1)
  redis.call('HINCRBY', worker, 'calls:' .. phase, 1)
  redis.call('HINCRBY', worker, 'sessions:' .. phase, ARGV[i + 1])
  redis.call('HINCRBY', worker, 'tokens:' .. phase, ARGV[i + 2])
  redis.call('HINCRBY', worker, 'batch_size:' .. ARGV[i + 1], 1)
  redis.call('HINCRBYFLOAT', worker, 'engine_seconds', ARGV[i + 3])
end

return out
