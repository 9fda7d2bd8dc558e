"""Bidirectional: what does P do with D params older than decoder_kv_blocks_ttl?"""
import json, sys, time
sys.path.insert(0, "/work/main/scratch")
import pd_modes_probe as m
P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"
wait = float(sys.argv[1]) if len(sys.argv) > 1 else 125
msgs = [{"role": "user", "content": m.user_text(1, salt="exp%d" % wait)}]
pr = m.post(P + "/v1/chat/completions", m.chat_body(msgs, 1, kv_transfer_params=dict(m.P_PARAMS_FRESH)))
dr = m.post(D + "/v1/chat/completions", m.chat_body(msgs, 96, kv_transfer_params=pr["kv_transfer_params"]))
held = dr["kv_transfer_params"]
t0 = time.time()
msgs += [{"role": "assistant", "content": m.detok(P, dr["choices"][0]["token_ids"])},
         {"role": "user", "content": m.user_text(2, salt="exp")}]
new_ids = m.tokenize(P, msgs)
params, k = m.guard_params({"params": held, "ids": (dr["prompt_token_ids"] + dr["choices"][0]["token_ids"])[:held["remote_num_tokens"]]}, new_ids, 128)
print("held R", held["remote_num_tokens"], "k", k, flush=True)
time.sleep(wait)
m0 = m.by_source(P)
try:
    r = m.post(P + "/v1/chat/completions", m.chat_body(msgs, 1, kv_transfer_params=params))
    print("after %.0fs:" % (time.time() - t0), json.dumps({"finish_reason": r["choices"][0]["finish_reason"], "usage": r["usage"], "kvp_keys": list((r.get("kv_transfer_params") or {}).keys())}))
except Exception as e:
    print("after %.0fs: ERROR %s" % (time.time() - t0, e))
print("P delta", m.delta(m0, m.by_source(P)))
