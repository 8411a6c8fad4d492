#!/usr/bin/env bash
# shellcheck disable=SC2329 # cleanup and the conditions are invoked through trap and check
# make image-test: build the CPU image and check it as docs/deployment.md runs it. Needs a Docker engine:
# with ENGINE (default ../shared/docker/engine.sh beside the checkout, when it exists) it is started here, the stand-in base
# made, and the engine stopped again at the end if this script started it; otherwise DOCKER_HOST's engine.
#
# Each check prints one line "image-test: ok|FAIL <what>: <figure>"; the exit status is the number of
# failures. Steps: build (from a copy of the working tree: the files git tracks or does not ignore), the
# image size and its layers, no compiler in it, run --read-only with the documented mounts (tmpfs, which
# Docker mounts noexec), /health, the CPU kernel loaded, one embedding against this checkout's venv,
# requests in flight through `docker stop -t 45` and its exit code, a rebuild after a source change (the
# dependency layer cached), and compose without the monitoring profile.
#
# Environment: PYTHON (the venv's python for the reference embedding; default .venv/bin/python),
# IMAGE (default embed-service:image-test), PORT (default 18000), WHEELS (a folder of wheels served to the
# build over loopback as PIP_FIND_LINKS, on WHEEL_PORT (default 18099); default: pip's configured
# find-links when they are a folder).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# ../shared beside the checkout; in a git worktree, beside the main checkout.
MAIN=$(cd "$(git -C "$ROOT" rev-parse --path-format=absolute --git-common-dir)/.." && pwd)
for ENGINE in "${ENGINE:-}" "$ROOT/../shared/docker/engine.sh" "$MAIN/../shared/docker/engine.sh"; do
  [ -x "$ENGINE" ] && break
done
DOCKER=${DOCKER:-/usr/bin/docker}
IMAGE=${IMAGE:-embed-service:image-test}
PORT=${PORT:-18000}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
STOP_TIMEOUT=45
WORK=$(mktemp -d)
FAILED=0
STARTED_ENGINE=0
SERVER_PID=

say() { printf 'image-test: %s\n' "$*"; }
ok() { say "ok $*"; }
fail() { say "FAIL $*"; FAILED=$((FAILED + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else fail "$what"; fi; }

cleanup() {
  "$DOCKER" rm -f embed-image-test >/dev/null 2>&1
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null
  if [ -f "$WORK/compose.yml" ]; then
    (cd "$WORK/src" && PATH=/usr/bin:$PATH docker-compose -p embedimagetest -f "$WORK/compose.yml" down -v \
      >/dev/null 2>&1)
  fi
  [ "$STARTED_ENGINE" = 1 ] && "$ENGINE" stop >&2
  rm -rf "$WORK"
}
trap cleanup EXIT

# ---- the engine ---------------------------------------------------------------------------------------------
if [ -x "$ENGINE" ]; then
  if ! "$ENGINE" status >/dev/null 2>&1; then STARTED_ENGINE=1; fi
  eval "$("$ENGINE" start)" || { fail "engine: $ENGINE start"; exit 1; }
  "$ENGINE" base >&2 || { fail "engine: the base image"; exit 1; }
fi
"$DOCKER" version --format '{{.Server.Version}}' >/dev/null || { fail "engine: no Docker engine answers"; exit 1; }

# ---- build from a copy of the working tree ------------------------------------------------------------------
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"

if [ -z "${WHEELS:-}" ]; then
  WHEELS=$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)
  WHEELS=${PIP_FIND_LINKS:-$WHEELS}
fi
BUILD_ARGS=()
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
  # Served over loopback (builds use the host's network): the script then finds the CPU build there.
  # A fixed port: the URL is a build argument, and another one would miss the dependency layer's cache.
  WHEEL_PORT=${WHEEL_PORT:-18099}
  "$PYTHON" -m http.server "$WHEEL_PORT" --bind 127.0.0.1 --directory "$WHEELS" >/dev/null 2>&1 &
  SERVER_PID=$!
  BUILD_ARGS+=(--build-arg "PIP_FIND_LINKS=http://127.0.0.1:$WHEEL_PORT/")
  say "wheels for the build: $WHEELS (PIP_FIND_LINKS over loopback)"
fi

build() {  # build LOG: the CPU image from $WORK/src
  local start=$SECONDS
  DOCKER_BUILDKIT=1 "$DOCKER" build --network host --progress plain "${BUILD_ARGS[@]}" -t "$IMAGE" "$WORK/src" \
    >"$1" 2>&1
  local rc=$?
  BUILD_S=$((SECONDS - start))
  return $rc
}

if build "$WORK/build.log"; then
  ok "build: ${BUILD_S}s"
else
  tail -30 "$WORK/build.log"
  fail "build (log above)"
  exit "$FAILED"
fi
grep -E '==> (installing torch|done)' "$WORK/build.log" | sed 's/^#[0-9]* [0-9.]* /  build: /' | head -3
torch_files=$("$DOCKER" run --rm --entrypoint sh "$IMAGE" -c \
  'ls /opt/venv/lib/python3*/site-packages | grep -ciE "^(nvidia|triton)" || true')
check "no CUDA wheels in the CPU image: $torch_files nvidia-*/triton entries" [ "$torch_files" = 0 ]
size=$("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE")
ok "image size: $((size / 1048576)) MiB ($size bytes)"
"$DOCKER" history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | awk -F'\t' '$1 != "0B" { printf "  layer %8s  %s\n", $1, substr($2, 1, 90) }'
compiler=$("$DOCKER" run --rm --entrypoint sh "$IMAGE" -c 'command -v gcc cc || true')
check "no C compiler in the image: '${compiler}'" [ -z "$compiler" ]

# ---- run as documented: read-only, tmpfs (noexec), no capabilities ------------------------------------------
"$DOCKER" rm -f embed-image-test >/dev/null 2>&1
"$DOCKER" run -d --name embed-image-test --network host -e EMBED_HOST=127.0.0.1 -e EMBED_PORT="$PORT" \
  --read-only --tmpfs /tmp --tmpfs /var/cache/embed-service:uid=10001 --tmpfs /home/embed/.cache:uid=10001 \
  --cap-drop ALL --security-opt no-new-privileges "$IMAGE" >/dev/null || { fail "docker run"; exit "$FAILED"; }
URL=http://127.0.0.1:$PORT
start=$SECONDS
until [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health")" = 200 ]; do
  if [ $((SECONDS - start)) -gt 300 ] || [ "$("$DOCKER" inspect -f '{{.State.Running}}' embed-image-test)" != true ]; then
    "$DOCKER" logs embed-image-test 2>&1 | tail -20
    fail "/health: not 200 within 300 s"
    exit "$FAILED"
  fi
  sleep 1
done
ok "/health 200 after $((SECONDS - start)) s (read-only root, tmpfs mounts, uid $("$DOCKER" exec embed-image-test id -u))"
curl -s "$URL/v1/embeddings" -H 'content-type: application/json' \
  -d '{"input": ["The container image serves the packaged model."]}' >"$WORK/image.json"
attention=$(curl -s "$URL/info" | "$PYTHON" -c 'import json, sys; i = json.load(sys.stdin); print(json.dumps(i).count("cpu-kernel"), [m.get("attention") for m in i.get("models", [i])])' 2>&1)
check "CPU kernel serving: /info attention $attention" grep -q 'cpu-kernel' <<<"$attention"
# Which level the loader picks, in the running container (workers log at warning level only).
kernel_line=$("$DOCKER" exec embed-image-test python -c 'import logging; logging.basicConfig(level=logging.INFO, format="%(message)s")
from embed_service.ops import cpu_kernels; cpu_kernels.attention_kernel()' 2>&1 | tail -1)
check "CPU kernel level: $kernel_line" grep -q 'prebuilt x86-64' <<<"$kernel_line"
kernel_warnings=$("$DOCKER" logs embed-image-test 2>&1 | grep -ciE 'kernel.*(not loaded|not built|unavailable|failed)' || true)
check "no kernel warnings in the log ($kernel_warnings)" [ "$kernel_warnings" = 0 ]

# ---- the same embedding from this checkout's venv ------------------------------------------------------------
# A file, not stdin: the workers are spawned processes, which import the main module by its path.
cat >"$WORK/compare.py" <<'EOF'
import json
import sys

import numpy as np


def main() -> int:
    from embed_service import Embedder

    image = np.array(json.load(open(sys.argv[1]))["data"][0]["embedding"], dtype=np.float32)
    with Embedder() as e:
        venv = e.encode(["The container image serves the packaged model."])[0].astype(np.float32)
    diff = float(np.abs(image - venv).max())
    cosine = float(image @ venv / np.linalg.norm(image) / np.linalg.norm(venv))
    same = "bit-identical" if np.array_equal(image, venv) else "differs"
    print(f"{same}: max |image - venv| {diff:.2e}, cosine {cosine:.7f}, dim {image.size}")
    return 0 if diff < 1e-5 else 1


if __name__ == "__main__":  # the workers are spawned: they import this file without running it
    sys.exit(main())
EOF
compare=$(cd "$ROOT" && PYTHONPATH=$ROOT/src "$PYTHON" "$WORK/compare.py" "$WORK/image.json" 2>"$WORK/compare.err")
compare_rc=$?
[ -z "$compare" ] && tail -5 "$WORK/compare.err"
check "embedding vs the venv: $compare" [ "$compare_rc" = 0 ]

# ---- requests in flight through docker stop -------------------------------------------------------------------
"$PYTHON" - "$URL" 40 >"$WORK/inflight.txt" 2>&1 <<'EOF' &
import concurrent.futures, json, sys, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
body = json.dumps({"input": [f"request {{i}} sentence {j} " * 20 for j in range(16)]}).encode()
def one(i):
    req = urllib.request.Request(url + "/v1/embeddings", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:
        return type(e).__name__
with concurrent.futures.ThreadPoolExecutor(n) as pool:
    results = list(pool.map(one, range(n)))
print(json.dumps({str(k): results.count(k) for k in set(results)}))
EOF
CLIENTS=$!
start=$SECONDS
# SIGTERM once (nearly) all 40 requests of 16 inputs are admitted: those finish with 200; one that arrives
# after SIGTERM gets 503 (never admitted), and a request cut off by SIGKILL gets no answer at all.
until curl -s "$URL/metrics" | grep -qE '^embed_inputs_in_flight\{[^}]*\} ([6-9][0-9][0-9]|[0-9]{4})'; do
  [ $((SECONDS - start)) -gt 30 ] && break
  sleep 0.1
done
in_flight=$(curl -s "$URL/metrics" | grep -E '^embed_inputs_in_flight\{' | awk '{print $NF}')
start=$SECONDS
"$DOCKER" stop -t "$STOP_TIMEOUT" embed-image-test >/dev/null
stop_s=$((SECONDS - start))
wait "$CLIENTS"
code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' embed-image-test)
drained() { [ "$code" = 0 ] && "$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(set(r) - {"200", "503"} or r.get("200", 0) < 30)' "$WORK/inflight.txt"; }
check "docker stop -t $STOP_TIMEOUT: exit code $code after ${stop_s}s; 40 requests, ${in_flight:-?} inputs in flight at SIGTERM: statuses $(cat "$WORK/inflight.txt")" \
  drained
"$DOCKER" logs embed-image-test 2>&1 | grep -iE 'drain|shutting down|stopped' | tail -3 | sed 's/^/  log: /'
"$DOCKER" rm embed-image-test >/dev/null

# ---- a source change rebuilds without reinstalling the dependencies ----------------------------------------
echo "# a source change" >>"$WORK/src/src/embed_service/__init__.py"
if build "$WORK/rebuild.log"; then
  deps_cached=$(grep -cE '^#[0-9]+ CACHED' "$WORK/rebuild.log")
  deps_step=$(grep -E '^#[0-9]+ \[cpu-deps [0-9]/[0-9]\] RUN' "$WORK/rebuild.log" | head -1 | cut -d' ' -f1)
  check "rebuild after a source change: ${BUILD_S}s, the dependency layer ($deps_step) cached; $deps_cached steps cached" \
    grep -qx "$deps_step CACHED" "$WORK/rebuild.log"
else
  tail -20 "$WORK/rebuild.log"
  fail "rebuild after a source change"
fi

# ---- compose: the server starts without the monitoring images ---------------------------------------------
if command -v docker-compose >/dev/null; then
  # The engine here has no bridge: host networking, and the port from the environment.
  "$PYTHON" - "$WORK/src/docker-compose.yml" "$WORK/compose.yml" "$PORT" <<'EOF'
import sys, yaml
stack = yaml.safe_load(open(sys.argv[1]))
for svc in stack["services"].values():
    svc.pop("ports", None)
    svc["network_mode"] = "host"
    if "build" in svc:
        svc["build"]["network"] = "host"
server = stack["services"]["embed-service"]
server["environment"].update({"EMBED_HOST": "127.0.0.1", "EMBED_PORT": sys.argv[3]})
server["image"] = "embed-service:image-test"
yaml.safe_dump(stack, open(sys.argv[2], "w"))
EOF
  (cd "$WORK/src" && PATH=/usr/bin:$PATH COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=1 \
    docker-compose -p embedimagetest -f "$WORK/compose.yml" up -d --no-build >"$WORK/compose.log" 2>&1)
  up=$?
  start=$SECONDS
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health")" = 200 ] || [ $((SECONDS - start)) -gt 300 ]; do
    sleep 1
  done
  services=$("$DOCKER" ps --filter label=com.docker.compose.project=embedimagetest \
    --format '{{.Label "com.docker.compose.service"}}' | sort | tr '\n' ' ')
  server_alone() { [ "$up" = 0 ] && [ "${services% }" = embed-service ]; }
  check "compose up (no profile): exit $up, services [${services% }], /health $(curl -s -o /dev/null -w '%{http_code}' "$URL/health")" \
    server_alone
fi

say "$FAILED failed"
exit "$FAILED"
