#!/usr/bin/env bash
# Submit a pairmine command to a running Ray cluster as a Ray job, follow its log, and exit with the job's own result.
#   RAY_ADDRESS=http://head:8265 deploy/submit.sh --input s3://corpus/fineweb/ --output s3://groups/ [--set ...]
#   RAY_ADDRESS=http://head:8265 deploy/submit.sh train --groups s3://groups/RUN --output s3://train/xprt [--set ...]
# The first argument may name the command (mine, train, negatives, filter-pairs, ablate, eval); without one it is mine.
# The cluster's image must have pairmine installed (docker/Dockerfile); inside the job, pairmine connects to the
# cluster through RAY_ADDRESS, which Ray sets for job drivers.
#
# Exit status: 0 when the job SUCCEEDED; when it FAILED or was STOPPED, pairmine's own exit code where Ray recorded
# it (2: a user error, its one `pairmine: error:` line is in the log; 130: interrupted; 143: SIGTERM, e.g. `ray job
# stop`), else 1. (`ray job submit` alone exits 0 for a STOPPED job, and a KubeRay submitter pod's exit code is that
# of `ray job logs`: neither is the job's result.) PAIRMINE_SUBMISSION_ID names the job (default: a dated id).
set -euo pipefail
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the Ray cluster, e.g. http://ray-head:8265}"
command=mine
case "${1:-}" in mine | train | negatives | filter-pairs | ablate | eval) command="$1"; shift ;; esac
id="${PAIRMINE_SUBMISSION_ID:-pairmine-$command-$(date -u +%Y%m%dT%H%M%SZ)-$$}"
ray job submit --address "$RAY_ADDRESS" --submission-id "$id" --no-wait -- pairmine "$command" "$@"
ray job logs --address "$RAY_ADDRESS" --follow "$id" || true  # the log; its own exit status is not the job's
# The Python that runs `ray` (its script's interpreter) has Ray's job-submission client.
py="$(sed -n '1s/^#!//p' "$(command -v ray)")"
case "$py" in */python*) ;; *) py="$(command -v python3)" ;; esac
exec "$py" - "$id" <<'PY'
import os
import sys

from ray.job_submission import JobStatus, JobSubmissionClient

job = sys.argv[1]
info = JobSubmissionClient(os.environ["RAY_ADDRESS"]).get_job_info(job)
code = info.driver_exit_code
if info.status == JobStatus.SUCCEEDED:
    print(f"submit.sh: job {job} succeeded")
    sys.exit(0)
exit_code = code if isinstance(code, int) and 0 < code < 256 else 1
print(f"submit.sh: job {job} ended {info.status} (driver exit code {code}; {info.message or 'no message'}): "
      f"exiting {exit_code}", file=sys.stderr)
sys.exit(exit_code)
PY
