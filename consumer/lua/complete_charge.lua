-- ---------------------------------------------------------------- charges
-- What one fresh row of a session with a billing account charges (docs/accounting.md): the prompt
-- positions it fed (`fed`: pos - fed .. pos - 1) at or above the session's high-water mark `hw`, or
-- owed below it, the rest recomputed; its sampled token (`tok`) at pos >= hw or owed, else
-- recomputed. Then hw moves past them, and the session's tally entry and its account's sums count the
-- row. A new counter: its tally field (schemas/accounting.py TALLY), a sum here and in `accounts`, and
-- its place in the record's charges (complete_publish.lua) and in the closure's fold (complete_close.lua).
-- Cached: of the prompt positions charged, those the worker restored from its prefix cache (`kc`: the
-- first kc of the fed positions) are also counted as `cached_tokens`, a part of `prompt_tokens` that a
-- Tracker may bill at its own rate. Rare (a session's first piece on a hit), so not a tally field: the
-- session hash takes it at once, in this script, so it is charged exactly when its positions are.
local accounts = {}  -- acct n -> {prompt, gen, recomp, steps, es, cached}

local function charge(sid, e, a, pos, fed, tok, es, kc)  -- -> prompt, generated, recomputed, cached
  local p, g, rc, k, hw = 0, 0, 0, 0, e[HW]
  if fed > pos then fed = pos end
  -- the first position the row computed: above hw, the ones in between are owed (lost answers)
  local lo = fed > 0 and pos - fed or (tok and pos or -1)
  if lo > hw then owe(sid, e, hw, lo - 1) end
  if fed > 0 then
    local from = pos - fed
    local cend = from + math.max(0, math.min(kc, fed))  -- restored: from .. cend - 1
    if from < hw then
      local top = math.min(pos, hw)
      if cend > from then
        k = take_owed(sid, e, from, math.min(cend, top) - 1)
        p = k + take_owed(sid, e, math.max(from, cend), top - 1)
      else
        p = take_owed(sid, e, from, top - 1)
      end
      from = hw
    end
    if pos > from then
      p = p + pos - from
      if cend > from then k = k + math.min(cend, pos) - from end
    end
    rc = fed - p
    if pos > hw then hw = pos end
  end
  if tok then
    if pos >= hw then
      g = 1
      hw = pos + 1
    elseif take_owed(sid, e, pos, pos) == 1 then
      g = 1
    else
      rc = rc + 1
    end
  end
  e[HW] = hw
  e[PROMPT], e[GEN], e[RECOMP], e[STEPS], e[ES] = e[PROMPT] + p, e[GEN] + g, e[RECOMP] + rc, e[STEPS] + 1,
    e[ES] + es
  dirty[sid] = true
  local s = accounts[a]
  if s == nil then
    s = {0, 0, 0, 0, 0.0, 0}
    accounts[a] = s
  end
  s[1], s[2], s[3], s[4], s[5] = s[1] + p, s[2] + g, s[3] + rc, s[4] + 1, s[5] + es
  if k > 0 then
    s[6] = s[6] + k
    redis.call('HINCRBY', KEYS[sk[sid]], 'cached_tokens', k)
  end
  return p, g, rc, k
end
