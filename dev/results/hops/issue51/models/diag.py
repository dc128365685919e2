"""RMS of the answer state's update at supervision steps 1..16 of saved hops_quick models (issue 51: does the state
settle?). PYTHONPATH=. python dev/results/hops/issue51/models/diag.py dev/results/hops/issue51/models/*.pt"""
import torch, sys
from dev.hops_quick import validation_rows
from nanochat.model.gpt import GPT, GPTConfig
torch.set_num_threads(1)
val = validation_rows()
for path in sys.argv[1:]:
    ck = torch.load(path)
    m = GPT(GPTConfig(**ck["config"])); m.load_state_dict(ck["state_dict"]); m.eval()
    d = m.diagnose(val[0][:64], n_sup=16)
    print(path, "rms of y's update by step:", " ".join(f"{v:.3f}" for v in d[:, 2].tolist()))
