"""What a server's answer looks like, protocol-wise, and how two such answers differ (the differential test).

* `load_probes()` — the requests of tests/data/vllm_server/probes.json, each `{"name", "method", "path",
  "body"}` (`"raw"`: a body sent as is, bad JSON on purpose).
* `send(client, probe)` — one probe to a server: its `answer`, what is compared and nothing else:
  the status, the JSON body's `shape` (key paths with value types, lists collapsed), an error's
  `type` / `code`, and for a stream (`text/event-stream`) the sequence of its events' shapes,
  consecutive repeats collapsed, with whether it ended in `data: [DONE]`.
* `differences(vllm, ours)` — the short strings that say how our answer differs from vLLM's:

      status: vllm 200, ours 400         body: vllm empty, ours json
      -x.y: str   (vLLM has the key)     +x.y: str   (we have it)       ~x.y: vllm str, ours list|str
      error.type: vllm X, ours Y         error.code: vllm 400, ours None
      (streams, their keys prefixed data.)  events: vllm NAMES; ours NAMES   [DONE]: vllm True, ours False
      steps: vllm 3, ours 4; step 2: +choices[].delta.content: str   (the first event whose shape differs)

Values (texts, token ids, logprobs) are never compared: the point is the protocol. A key whose value is null
counts as absent, and an answer where the other has an error is told by its status alone.
"""

from __future__ import annotations

import json
import os

import httpx

PROBES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "vllm_server", "probes.json")
RECORDING = os.path.join(os.path.dirname(PROBES), "vllm_0.32.0.json")

# dicts whose keys are data (tokens, token ids): their keys collapse to `*`
DATA_KEYS = ("choices[].logprobs.top_logprobs[]", "prompt_logprobs[]", "choices[].prompt_logprobs[]")


def load_probes(path: str = PROBES) -> list[dict]:
    with open(path) as f:
        return json.load(f)["probes"]


def load_recording(path: str = RECORDING) -> dict:
    with open(path) as f:
        return json.load(f)


# --- shapes ---------------------------------------------------------------------------------------------------
def _type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    return "list" if isinstance(value, list) else "object"


def shape(value) -> dict[str, str]:
    """{key path: "type|type"} over a JSON value: `choices[].message.content: null|str`; the root is `$`."""
    found: dict[str, set[str]] = {}

    def walk(v, path: str) -> None:
        found.setdefault(path or "$", set()).add(_type(v))
        if isinstance(v, dict):
            for k, item in v.items():
                k = "*" if path in DATA_KEYS else k
                walk(item, f"{path}.{k}" if path else k)
        elif isinstance(v, list):
            for item in v:
                walk(item, f"{path}[]")

    walk(value, "")
    return {p: "|".join(sorted(t)) for p, t in sorted(found.items())}


# --- answers --------------------------------------------------------------------------------------------------
def parse_sse(text: str) -> tuple[list[tuple[str | None, object]], bool]:
    """Server-sent events as [(event name or None, parsed data)], and whether `data: [DONE]` ended them."""
    events, done = [], False
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if not data:
            continue
        payload = "\n".join(data)
        if payload == "[DONE]":
            done = True
            continue
        try:
            events.append((name, json.loads(payload)))
        except json.JSONDecodeError:
            events.append((name, payload))
    return events, done


def stream_steps(events) -> list[dict]:
    """The stream's structure: one step per run of consecutive events of one name and shape."""
    steps: list[dict] = []
    for name, data in events:
        step = {"event": name, "shape": shape(data)}
        if isinstance(data, dict) and len(data.get("choices") or ()) > 1:
            step["shape"]["choices#"] = "several"      # n > 1: OpenAI and vLLM send one choice per chunk
        if steps and steps[-1]["event"] == name and steps[-1]["shape"] == step["shape"]:
            steps[-1]["repeated"] = True
            continue
        steps.append(step)
    return steps


def describe(response: httpx.Response) -> dict:
    """The protocol-level answer: what `differences` compares."""
    out: dict = {"status": response.status_code}
    kind = response.headers.get("content-type", "").split(";")[0].strip()
    if kind == "text/event-stream":
        events, done = parse_sse(response.text)
        out.update(body="sse", steps=stream_steps(events), done=done)
        errors = [d for _, d in events if isinstance(d, dict) and "error" in d]
        if errors:
            out["error"] = _error_fields(errors[0])
        return out
    try:
        body = response.json()
    except ValueError:
        out["body"] = "empty" if not response.content else "text"
        return out
    out.update(body="json", shape=shape(body))
    if response.status_code >= 400 or (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        out["error"] = _error_fields(body)
    return out


def _error_fields(body) -> dict:
    """An error's type and code (compared), its param and the start of its message (for people: not compared)."""
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else (body if isinstance(body, dict) else {})
    message = err.get("message", err.get("detail"))
    return {"type": err.get("type"), "code": err.get("code"), "param": err.get("param"), "message": str(message)[:300]}


def send(client: httpx.Client, probe: dict) -> dict:
    """Send one probe (its body as JSON, or `raw` as is) and describe the answer."""
    kw: dict = {}
    if "raw" in probe:
        kw = {"content": probe["raw"].encode(), "headers": {"content-type": "application/json"}}
    elif "body" in probe:
        kw = {"json": probe["body"]}
    return describe(client.request(probe.get("method", "POST"), probe["path"], **kw))


# --- differences ----------------------------------------------------------------------------------------------
def shape_differences(vllm: dict[str, str], ours: dict[str, str], prefix: str = "") -> list[str]:
    out = [f"-{prefix}{p}: {vllm[p]}" for p in vllm if p not in ours]
    out += [f"+{prefix}{p}: {ours[p]}" for p in ours if p not in vllm]
    out += [f"~{prefix}{p}: vllm {vllm[p]}, ours {ours[p]}" for p in vllm if p in ours and vllm[p] != ours[p]]
    return sorted(out)


def _present(shape_: dict[str, str]) -> dict[str, str]:
    """A shape with null dropped: a key whose value is null counts as absent (OpenAI's clients read both alike)."""
    out = {p: "|".join(t for t in types.split("|") if t != "null") for p, types in shape_.items()}
    return {p: t for p, t in out.items() if t}


def _dedupe(names: list[str]) -> list[str]:
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def _union(steps: list[dict]) -> dict[str, str]:
    types: dict[str, set[str]] = {}
    for s in steps:
        for p, t in s["shape"].items():
            types.setdefault(p, set()).update(t.split("|"))
    return {p: "|".join(sorted(t)) for p, t in types.items()}


def _restricted(steps: list[dict], keep: dict[str, bool]) -> list[tuple]:
    """Steps over the keys both streams have (a type the two disagree on: `?`), repeats merged again."""
    out: list[tuple] = []
    for s in steps:
        step = (s["event"], tuple(sorted((p, t if keep[p] else "?") for p, t in s["shape"].items() if p in keep)))
        if not out or out[-1] != step:
            out.append(step)
    return out


def stream_differences(vllm: dict, ours: dict) -> list[str]:
    """A stream's keys and types (over all its events), then its structure over the keys both have: the
    sequence of event names and shapes (first role-only chunk, content chunks, finish chunk, usage chunk...),
    reported at the first step where they part; then the [DONE] terminator."""
    vu, ou = _union(vllm["steps"]), _union(ours["steps"])
    out = shape_differences(vu, ou, prefix="data.")
    vnames, onames = (_dedupe([s["event"] for s in a["steps"] if s["event"]]) for a in (vllm, ours))
    if vnames != onames:
        out.append(f"events: vllm {' '.join(vnames)}; ours {' '.join(onames)}")
    keep = {p: vu[p] == ou[p] for p in vu if p in ou}
    vs, os_ = _restricted(vllm["steps"], keep), _restricted(ours["steps"], keep)
    if vs != os_:
        i = next(i for i in range(min(len(vs), len(os_)) + 1) if i == min(len(vs), len(os_)) or vs[i] != os_[i])
        if i == len(vs) or i == len(os_):
            what = f"{'vllm' if i == len(vs) else 'ours'} ends"
        else:
            (ve, vshape), (oe, oshape) = vs[i], os_[i]
            what = (f"event vllm {ve}, ours {oe}" if ve != oe else
                    " ".join(shape_differences(dict(vshape), dict(oshape))))
        out.append(f"steps: vllm {len(vs)}, ours {len(os_)}; step {i}: {what}")
    if vllm["done"] != ours["done"]:
        out.append(f"[DONE]: vllm {vllm['done']}, ours {ours['done']}")
    return out


def differences(vllm: dict, ours: dict) -> list[str]:
    """How our answer to a probe differs from vLLM's (empty: the same status, keys, types and stream structure).
    An answer where the other has an error (a status, a stream's error event) is told by that alone; null counts
    as absent (`_present`)."""
    out = []
    if vllm["status"] != ours["status"]:
        out.append(f"status: vllm {vllm['status']}, ours {ours['status']}")
        if (vllm["status"] >= 400) != (ours["status"] >= 400):
            return out
    if vllm.get("body") == ours.get("body") == "sse" and ("error" in vllm) != ("error" in ours):
        kinds = [(a.get("error") or {}).get("type") for a in (vllm, ours)]
        return out + [f"stream error event: vllm {kinds[0]}, ours {kinds[1]}"]
    if vllm.get("body") != ours.get("body"):
        out.append(f"body: vllm {vllm.get('body')}, ours {ours.get('body')}")
    elif vllm.get("body") == "json":
        out += shape_differences(_present(vllm["shape"]), _present(ours["shape"]))
    elif vllm.get("body") == "sse":
        out += stream_differences(*({**a, "steps": [{**s, "shape": _present(s["shape"])} for s in a["steps"]]}
                                    for a in (vllm, ours)))
    for field in ("type", "code"):
        v, o = (vllm.get("error") or {}).get(field), (ours.get("error") or {}).get(field)
        if v != o and "error" in vllm and "error" in ours:
            out.append(f"error.{field}: vllm {v}, ours {o}")
    return out
