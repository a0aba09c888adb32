"""A LoRA adapter the Go tiny engine saved (testdata/lora_peft/adapter, a PEFT folder) loads with
peft onto transformers' model of builtin:tiny-arith and gives the logits the Go engine computes
with it (regenerate with `go test ./engines/tiny -run TestLoRAPEFTFixture -update`)."""

import json

import torch
from peft import PeftConfig, PeftModel
from transformers import AutoModelForCausalLM

from conftest import REPO

FIXTURE = REPO / "testdata" / "lora_peft"
BUILTIN = REPO / "engines" / "tiny" / "builtin" / "tiny-arith"


def relative_error(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_peft_loads_the_go_adapter_and_gives_its_logits():
    want = json.loads((FIXTURE / "expected.json").read_text())
    assert want["base"] == "builtin:tiny-arith"
    cfg = PeftConfig.from_pretrained(FIXTURE / "adapter")
    assert cfg.peft_type == "LORA" and cfg.r == 4 and cfg.lora_alpha == 8
    base = AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32)
    ids = torch.tensor([want["ids"]])
    with torch.no_grad():
        base_logits = base(ids).logits[0].clone()
    model = PeftModel.from_pretrained(base, FIXTURE / "adapter")
    model.eval()
    # Every A and B of the folder was loaded (none left at peft's initialisation).
    lora = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 7 * base.config.num_hidden_layers
    with torch.no_grad():
        got = model(ids).logits[0]
    ref = torch.tensor(want["logits"])
    assert got.shape == ref.shape
    assert relative_error(base_logits, ref) > 1e-2, "the adapter must change the logits"
    err = relative_error(got, ref)
    assert err < 1e-4, f"relative error {err:.2e}"


def test_transformers_loads_the_merged_export_and_gives_the_adapter_logits():
    """testdata/lora_peft/merged is `slimen export --merge` of the adapter (the Go engine's
    TestLoRAMergedExport keeps it in step): a plain model that computes base + adapter."""
    want = json.loads((FIXTURE / "expected.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(FIXTURE / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(torch.tensor([want["ids"]])).logits[0]
    err = relative_error(got, torch.tensor(want["logits"]))
    assert err < 1e-4, f"relative error {err:.2e}"
