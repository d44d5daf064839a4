"""A proxy's content key: what decides the proxy a ProxyModel builds, hashed, so that a proxy
already made for a checkpoint (by a CheckpointWatch) is found by label and used again instead of
being built a second time (a Diagnosis's bisection probe, diagnosis_bisect).

What goes in:
- the checkpoint: its location (uri, endpoint) and its listing's fingerprint (names, sizes and
  ETags of its files, `listing.Candidate.fingerprint`): a checkpoint rewritten at the same path
  gets another key;
- the build: spec.pruning as the build reads it (defaults applied, so an option spelled out or
  left to its default is the same build), sequential, spec.calibration, and what runs the build
  (the transformer's image, command, args and env); for a keep ratio, the accelerator request
  its expert count is sized for (as the build's own build id counts the device budget).
What does not: where the proxy is written, where its pods run (resources, nodes, queue, workers)
and the ProxyModel's own reproduction, none of which changes the proxy; nor spec.pruning.fillDead
(a probe's), which changes no proxy a build without it makes, only makes one where that build
refuses (and a failed ProxyModel is never reused).

Every ProxyModel the operator makes carries the key as a label (LABEL_CONTENT_KEY, 16 hex
characters: listable by label selector) and what went into it as an annotation (ANNOTATION_CONTENT).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from .resources import GROUP
from .settings import Settings
from .spec import InvalidSpec, parse

LABEL_CONTENT_KEY = f"{GROUP}/content-key"
ANNOTATION_CONTENT = f"{GROUP}/content"


def content(spec: dict, fingerprint: str | None, settings: Settings) -> dict:
    """What decides the proxy of a ProxyModel `spec` (as made, with its source) built from the
    checkpoint whose listing has `fingerprint` (None: not known, and then never reused)."""
    s = parse(spec, "namespace", "name", settings)  # the defaults the build will see
    w = s.transformer
    # fillDead (a probe's) makes the same proxy as a build without it, or one where that refuses
    pruning = {k: v for k, v in asdict(s.pruning.options).items() if k != "fill_dead"}
    build = {"pruning": pruning, "sequential": s.pruning.sequential,
             "calibration": asdict(s.calibration) if s.calibration else None,
             "transformer": {"image": w.image, "command": w.command, "args": w.args, "env": w.env}}
    if s.pruning.options.keep_ratio is not None:  # its count is sized for the devices asked for
        build["accelerator"] = asdict(s.reproduction.accelerator)
    return {"checkpoint": {"uri": s.source.uri.rstrip("/"), "endpoint": s.source.endpoint, "files": fingerprint},
            "build": build}


def content_key(what: dict) -> str:
    """16 hex characters of the SHA-256 of `content(...)` (a label value)."""
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def label(manifest: dict, fingerprint: str | None, settings: Settings) -> str | None:
    """Put the key and its content on a ProxyModel manifest (in place); returns the key. A spec the
    ProxyModel will refuse gets none (its refusal says why; nothing reuses it)."""
    try:
        what = content(manifest["spec"], fingerprint, settings)
    except InvalidSpec:
        return None
    key = content_key(what)
    manifest["metadata"].setdefault("labels", {})[LABEL_CONTENT_KEY] = key
    manifest["metadata"].setdefault("annotations", {})[ANNOTATION_CONTENT] = json.dumps(what, sort_keys=True,
                                                                                       default=str)
    return key


def key_of(proxymodel: dict) -> str | None:
    return ((proxymodel.get("metadata") or {}).get("labels") or {}).get(LABEL_CONTENT_KEY)
