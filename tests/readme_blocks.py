"""The README's code blocks, as tests/test_readme.py and tests/test_adapter_vllm_frameworks.py run them."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
PYTHON: list[str] = re.findall(r"^```python\n(.*?)^```", README, re.DOTALL | re.MULTILINE)
SHELL: list[str] = re.findall(r"^```bash\n(.*?)^```", README, re.DOTALL | re.MULTILINE)
NEEDS_SERVER = "AGENTSTATE_URL"
"""What the blocks that talk to a vLLM server with the connector's session API read their address from."""
NEEDS_SERVICE = "AGENTSTATE_SERVICE_URL"
"""What the SDK block reads the address of `agentstate serve` from."""
