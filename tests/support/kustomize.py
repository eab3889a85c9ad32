"""The part of kustomize that examples/kubernetes uses, in Python, so that the tests can build
every overlay without a kustomize binary: ``resources`` (files and directories), ``components``,
``patches`` (strategic merge, each naming its target by kind and name), ``namespace``,
``labels`` (metadata only) and ``images``. A field or a patch directive outside that subset
fails the build, naming it, rather than being skipped: the output is what ``kubectl kustomize``
prints for these manifests, or an error. ``tests/unit/test_examples.py`` compares the two
wherever ``kubectl`` is installed.

The order of a merged list follows kustomize's: a patch's entries first (each merged into the
entry of the same key, if any), then the entries the patch does not name. That order matters:
Kubernetes expands ``$(VAR)`` in an env value only from the entries above it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "components", "images",
          "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}
# Lists merged by a key in a strategic merge patch (Kubernetes' patchMergeKey); every other
# list is replaced whole.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "imagePullSecrets": "name", "volumeMounts": "mountPath"}


class KustomizeError(AssertionError):
    pass


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load_kustomization(root: Path) -> Doc:
    path = root / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    kust: Doc = yaml.safe_load(path.read_text())
    return kust


def build(root: Path, kust: Doc | None = None) -> list[Doc]:
    """What ``kubectl kustomize root`` prints, as documents (in no particular order). ``kust``
    stands for ``root/kustomization.yaml`` when given (its paths relative to ``root``)."""
    if kust is None:
        kust = load_kustomization(root)
    if kust.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{root}: a {kust['kind']} cannot be built on its own")
    docs: list[Doc] = []
    for res in kust.get("resources", []):
        docs += _resource(root / res)
    return _layer(root, kust, docs)


def _resource(target: Path) -> list[Doc]:
    if target.is_dir():
        return build(target)
    if not target.is_file():
        raise KustomizeError(f"resource {target} does not exist")
    return load_docs(target)


def _layer(root: Path, kust: Doc, docs: list[Doc]) -> list[Doc]:
    """A kustomization's or a component's components and transformers on ``docs``."""
    unknown = set(kust) - FIELDS
    if unknown:
        raise KustomizeError(f"{root}: kustomize fields this subset lacks: {sorted(unknown)}")
    for comp in kust.get("components", []):
        comp_root = root / comp
        ckust = load_kustomization(comp_root)
        if ckust.get("kind") != "Component":
            raise KustomizeError(f"{comp_root}: listed as a component, is a {ckust.get('kind')}")
        own = [d for res in ckust.get("resources", []) for d in _resource(comp_root / res)]
        docs = _layer(comp_root, ckust, docs + own)
    for entry in kust.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{root}: patch {entry}: only `path:` (a strategic merge patch "
                                 "naming its target) is implemented here")
        for patch in load_docs(root / entry["path"]):
            _apply_patch(docs, patch, f"{root / entry['path']}")
    if "namespace" in kust:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = kust["namespace"]
    for entry in kust.get("labels", []):
        if set(entry) != {"pairs"}:
            raise KustomizeError(f"{root}: labels {entry}: only `pairs` (metadata labels) here")
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for image in kust.get("images", []):
        if not set(image) <= {"name", "newName", "newTag"}:
            raise KustomizeError(f"{root}: images {image}: only name, newName and newTag here")
        for d in docs:
            _set_image(d, image)
    return docs


def _apply_patch(docs: list[Doc], patch: Doc, where: str) -> None:
    targets = [d for d in docs if d["kind"] == patch["kind"]
               and d["metadata"]["name"] == patch["metadata"]["name"]
               and d["apiVersion"] == patch["apiVersion"]]
    if len(targets) != 1:
        raise KustomizeError(f"{where}: patch for {patch['kind']} {patch['metadata']['name']} "
                             f"matches {len(targets)} resources")
    merge(targets[0], patch)


def merge(base: Doc, patch: Doc) -> None:
    """A strategic merge patch of ``patch`` into ``base``, in place (null deletes a field)."""
    for key, value in patch.items():
        if key.startswith("$"):
            raise KustomizeError(f"patch directive {key} is not implemented here")
        old = base.get(key)
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(old, dict):
            merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) and _merge_key(key, old + value):
            base[key] = _merge_list(old, value, _merge_key(key, old + value))
        else:
            base[key] = copy.deepcopy(value)


def _merge_key(field: str, items: list[Any]) -> str:
    if field == "ports":  # a container's ports merge by containerPort, a Service's by port
        return "containerPort" if all("containerPort" in i for i in items) else "port"
    return MERGE_KEYS.get(field, "")


def _merge_list(old: list[Doc], patch: list[Doc], key: str) -> list[Doc]:
    rest = {item[key]: item for item in old}
    merged = []
    for item in patch:
        if item[key] in rest:
            target = rest.pop(item[key])
            merge(target, item)
            merged.append(target)
        else:
            merged.append(copy.deepcopy(item))
    return merged + [item for item in old if item[key] in rest]


def _set_image(node: Any, image: Doc) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    name, sep, tag = c["image"].rpartition(":")
                    if not sep or "/" in tag:
                        name, tag = c["image"], ""
                    if name == image["name"]:
                        tag = image.get("newTag", tag)
                        c["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
            else:
                _set_image(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_image(item, image)
