-- ---------------------------------------------------------------- charges
-- What one fresh row of a session with a billing account charges (docs/accounting.md): the prompt
-- positions it fed (`fed`: pos - fed .. pos - 1) at or above the session's high-water mark `hw`, or
-- owed below it, the rest recomputed; its sampled token (`tok`) at pos >= hw or owed, else
-- recomputed. Then hw moves past them, and the session's tally entry and its account's sums count the
-- row. A new counter: its tally field (schemas/accounting.py TALLY), a sum here and in `accounts`, and
-- its place in the record's charges (complete_publish.lua) and in the closure's fold (complete_close.lua).
local accounts = {}  -- acct n -> {prompt, gen, recomp, steps, es}

local function charge(sid, e, a, pos, fed, tok, es)  -- -> prompt, generated, recomputed
  local p, g, rc, hw = 0, 0, 0, e[HW]
  if fed > pos then fed = pos end
  -- the first position the row computed: above hw, the ones in between are owed (lost answers)
  local lo = fed > 0 and pos - fed or (tok and pos or -1)
  if lo > hw then owe(sid, e, hw, lo - 1) end
  if fed > 0 then
    local from = pos - fed
    if from < hw then
      p = take_owed(sid, e, from, math.min(pos, hw) - 1)
      from = hw
    end
    if pos > from then p = p + pos - from end
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
    s = {0, 0, 0, 0, 0.0}
    accounts[a] = s
  end
  s[1], s[2], s[3], s[4], s[5] = s[1] + p, s[2] + g, s[3] + rc, s[4] + 1, s[5] + es
  return p, g, rc
end
