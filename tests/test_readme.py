"""The README's Python example runs exactly as printed, and says what it claims."""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def python_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no ```python block"
    return blocks[0]


@pytest.mark.real
def test_readme_python_example_runs_verbatim(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(python_example(), "README.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "tau " in out and (tmp_path / "my-heads" / "heads.safetensors").is_file()
    model, ids, mask, tok = scope["model"], scope["ids"], scope["mask"], scope["tok"]
    assert scope["out"].shape[1] > ids.shape[1] and model.config.extra  # trained heads, something generated
    ref = model.base_model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    assert torch.equal(scope["out"], ref)  # the claim in the example's comment
    assert tok.decode(ids[0]).startswith("<|im_start|>system") and tok.decode(ids[0]).endswith("<|im_start|>assistant\n")
