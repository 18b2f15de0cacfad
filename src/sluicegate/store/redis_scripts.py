"""The Lua scripts of the Redis store: each operation on a stream is one atomic script.

Keys of stream ``X`` share the hash tag ``{X}`` (one Redis Cluster slot), and every
write script gets them in this order::

    KEYS[1] state   hash: last_seq, finished, gap_floor, meta, status, extra, taker
    KEYS[2] log     stream: event seq N has entry id "N-0" and field d=<bytes>;
                    finish adds the end marker "LAST-1" (field e), so entry ids, and
                    hence seqs, survive a failover and XREAD wakes on the end too
    KEYS[3] tokens  list: generated token ids, appended with their event
    KEYS[4] known   string: outlives the rest by replay_tombstone_seconds, so that an
                    expired stream can be told from one that never existed
    KEYS[5] lease   string: the owner of the generation lease, with a PX expiry

Every write refreshes the TTL of the first four.  Replies are arrays whose first
element is a status code (see ``CODE_*``).
"""

from __future__ import annotations

CODE_OK = 1
CODE_NOOP = 0
CODE_NOT_FOUND = -1
CODE_EXPIRED = -2
CODE_LEASE_LOST = -3
CODE_CLOSED = -4
CODE_NO_META = -5
CODE_BAD_POSITION = -6

# ARGV[1] ttl ms, ARGV[2] tombstone ttl ms, ARGV[3] owner ('' = unfenced).
_WRITE_PREAMBLE = """
local function refresh()
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ARGV[1])
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[2])
end
local function push_tokens(from)
  local i = from
  while i <= #ARGV do
    local j = math.min(i + 999, #ARGV)
    redis.call('RPUSH', KEYS[3], unpack(ARGV, i, j))
    i = j + 1
  end
end
if ARGV[3] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[3] then
  return {-3, 0}
end
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[4]) == 1 then
  return {-2, 0}
end
"""

#: ARGV[4] data, [5] maxlen, [6] exact trim '1'/'0', [7] gap '1'/'0', [8..] token ids.
#: Returns {1, seq}.
APPEND_LUA = (
    _WRITE_PREAMBLE
    + """
if redis.call('HGET', KEYS[1], 'finished') == '1' then
  return {-4, 0}
end
local seq = redis.call('HINCRBY', KEYS[1], 'last_seq', 1)
if ARGV[7] == '1' then
  redis.call('HSET', KEYS[1], 'gap_floor', seq)
end
if ARGV[6] == '1' then
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[5], seq .. '-0', 'd', ARGV[4])
else
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], seq .. '-0', 'd', ARGV[4])
end
push_tokens(8)
refresh()
return {1, seq}
"""
)

#: ARGV[4] gap '1'/'0'.  Returns {1, last_seq}, or {0, last_seq} if already finished.
FINISH_LUA = (
    _WRITE_PREAMBLE
    + """
local state = redis.call('HMGET', KEYS[1], 'finished', 'last_seq')
local last = tonumber(state[2] or '0')
if state[1] == '1' then
  return {0, last}
end
redis.call('HSET', KEYS[1], 'finished', '1', 'status', 'finished', 'last_seq', last)
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'gap_floor', last + 1)
end
redis.call('XADD', KEYS[2], last .. '-1', 'e', '1')
refresh()
return {1, last}
"""
)

#: ARGV[4] meta json, [5] status, [6] extra json, [7..] generated token ids.
PUT_META_LUA = (
    _WRITE_PREAMBLE
    + """
local status = ARGV[5]
if redis.call('HGET', KEYS[1], 'finished') == '1' then
  status = 'finished'
end
redis.call('HSET', KEYS[1], 'meta', ARGV[4], 'status', status, 'extra', ARGV[6])
redis.call('HSETNX', KEYS[1], 'last_seq', 0)
redis.call('DEL', KEYS[3])
push_tokens(7)
refresh()
return {1, 0}
"""
)

#: ARGV[4] status ('' = unchanged), [5] extra json ('' = unchanged), [6] compiled_from
#: ('' = unchanged).
UPDATE_META_LUA = (
    _WRITE_PREAMBLE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {-1, 0}
end
local state = redis.call('HMGET', KEYS[1], 'meta', 'finished')
if not state[1] then
  return {-5, 0}
end
if ARGV[4] ~= '' and state[2] ~= '1' then
  redis.call('HSET', KEYS[1], 'status', ARGV[4])
end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'extra', ARGV[5])
end
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'compiled_from', ARGV[6])
end
refresh()
return {1, 0}
"""
)

#: KEYS: state, tokens, known.  Returns {1, meta json, status, extra json, {token ids},
#: compiled_from or false}.
GET_META_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then return {-2} end
  return {-1}
end
local state = redis.call('HMGET', KEYS[1], 'meta', 'status', 'extra', 'compiled_from')
if not state[1] then
  return {-5}
end
return {1, state[1], state[2], state[3], redis.call('LRANGE', KEYS[2], 0, -1), state[4]}
"""

#: KEYS: state, log, known.  ARGV[1] after_seq, [2] max events ('0' = all).
#: Returns {1, last_seq, finished 1/0, resumable_from_seq, entries}; entries start after
#: max(after_seq, resumable_from_seq) and may end with the end marker.
#: {-6, last_seq} when after_seq > last_seq.
READ_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then return {-2} end
  return {-1}
end
local state = redis.call('HMGET', KEYS[1], 'last_seq', 'finished', 'gap_floor')
local last = tonumber(state[1] or '0')
local after = tonumber(ARGV[1])
if after > last then
  return {-6, last}
end
local first_seq = last + 1
local firsts = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
if #firsts > 0 then
  local id = firsts[1][1]
  local dash = string.find(id, '-', 1, true)
  first_seq = tonumber(string.sub(id, 1, dash - 1))
  if string.sub(id, dash + 1) ~= '0' then
    first_seq = first_seq + 1
  end
end
local resumable = math.max(first_seq - 1, tonumber(state[3] or '0'))
local start = math.max(after, resumable) .. '-1'
local entries
if ARGV[2] == '0' then
  entries = redis.call('XRANGE', KEYS[2], start, '+')
else
  entries = redis.call('XRANGE', KEYS[2], start, '+', 'COUNT', ARGV[2])
end
local finished = 0
if state[2] == '1' then finished = 1 end
return {1, last, finished, resumable, entries}
"""

#: KEYS[1] lease, [2] state.  ARGV[1] owner, [2] ttl ms.  1 if the owner holds it now;
#: the state records who took it last ('taker').
ACQUIRE_LEASE_LUA = """
local taken = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
if not taken then
  if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'taker', ARGV[1])
end
return 1
"""

#: KEYS[1] lease, [2] state.  ARGV[1] owner, [2] ttl ms.  A lease that lapsed while
#: nobody else took it (the owner is still the state's taker) is taken back, unless the
#: stream is finished.
RENEW_LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder then
  return 0
end
local state = redis.call('HMGET', KEYS[2], 'taker', 'finished')
if state[1] == ARGV[1] and state[2] ~= '1' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

#: KEYS[1] lease.  ARGV[1] owner.
RELEASE_LEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
