"""Checks each compose.yaml service's command line with `sanmai plan`.

    python compose_check.py SANMAI REPO CONFIG.yaml...

Each CONFIG.yaml is `podman-compose --profile P config` output. A service's `serve` command line
becomes a `sanmai plan` one: the preset's path in the image (/etc/sanmai/deploy/) is read from the
repository's configs/deploy/, `--model /model` plans the model the presets are sized for (the 125B
qwen4_exp config), the flags plan does not take (host, port, PLE table) are left out, and where neither
the command line nor the preset sets --gpu-memory-budget, the service's card is planned at the default
--gpu-memory-utilization 0.9 of its memory (CI has no GPU to ask).
"""

import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

IMAGE_PRESETS = "/etc/sanmai/deploy/"
MODEL_CONFIG = "configs/models/qwen4-exp-125b-a6b.json"
# Serve flags with a value that `sanmai plan` does not take.
SERVE_ONLY = {"--host", "--port", "--served-model-name", "--api-key", "--chat-template",
              "--tool-call-parser", "--default-chat-template-kwargs", "--max-request-bytes",
              "--ple-table"}
# 0.9 of the memory the driver reports for each card (MiB): an RTX 3090's 24,124 and an H200's 143,771.
CARD_BUDGET = {"3x3090": "21711MiB", "3x3090-mtp": "21711MiB", "1xh200": "129393MiB"}


def plan_args(name, service, repo):
    cmd = [str(a) for a in service["command"]]
    if cmd[0] != "serve":
        raise SystemExit(f"{name}: the command is not `sanmai serve`: {cmd}")
    out, i, preset = ["plan"], 1, None
    while i < len(cmd):
        flag = cmd[i]
        value = cmd[i + 1] if i + 1 < len(cmd) else None
        if flag in SERVE_ONLY:
            i += 2
            continue
        if flag == "--preset":
            if not value.startswith(IMAGE_PRESETS):
                raise SystemExit(f"{name}: the preset {value} is not one the image holds")
            preset = repo / "configs/deploy" / value[len(IMAGE_PRESETS):]
            out += ["--preset", str(preset)]
            i += 2
        elif flag == "--model":
            out += ["--config", str(repo / MODEL_CONFIG)]
            i += 2
        else:
            out.append(flag)
            i += 1
    on_cpu = "cpu" in cmd[cmd.index("--device") + 1] if "--device" in cmd else False
    budget_set = "--gpu-memory-budget" in cmd or (
        preset is not None and "gpu-memory-budget" in tomllib.loads(preset.read_text()))
    if not on_cpu and not budget_set:
        profile = service.get("profiles", [name])[0]
        out += ["--gpu-memory-budget", CARD_BUDGET[profile]]
    return out


def main():
    sanmai, repo, configs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    checked, failed = 0, []
    for path in configs:
        services = yaml.safe_load(Path(path).read_text())["services"]
        for name, service in services.items():
            args = plan_args(name, service, repo)
            print(f"--- {name}: sanmai {' '.join(args)}", flush=True)
            rc = subprocess.run([sanmai, *args]).returncode
            checked += 1
            if rc != 0:
                failed.append(name)
    print(f"compose services planned: {checked - len(failed)} of {checked}")
    if failed or checked == 0:
        raise SystemExit(f"sanmai plan refused: {failed or 'no service found'}")


if __name__ == "__main__":
    main()
