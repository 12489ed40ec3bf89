"""Fair share between clients: one client's many requests do not keep another's from the next
free slot, nor fill the waiting queue. The policy without a model (tests/core_driver.py,
states built by the fold), then over HTTP on the demo model."""

from __future__ import annotations

import json
from pathlib import Path

from core_driver import params

from stepline.events.fold import fold
from stepline.events.log import read_events
from stepline.events.models import Admitted


def test_a_version_3_log_loads_with_every_request_from_the_anonymous_client(tmp_path: Path):
    path = tmp_path / "v3.jsonl"
    header = {"type": "header", "schema_version": 3, "created": 1.0}
    admitted = {
        "seq": 1,
        "ts": 1.0,
        "step": 1,
        "type": "admitted",
        "request_id": "r",
        "num_prompt_tokens": 2,
        "prompt_token_ids": [5, 6],
        "prompt_sha256": "x",
        "params": params().model_dump(mode="json"),
    }
    path.write_text(f"{json.dumps(header)}\n{json.dumps(admitted)}\n", encoding="utf-8")
    (event,) = read_events(path)
    assert isinstance(event, Admitted) and event.client is None
    assert fold([event])["r"].client is None
