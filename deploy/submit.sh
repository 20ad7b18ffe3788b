#!/usr/bin/env bash
# Submit a mining run to a running Ray cluster as a Ray job.
#   RAY_ADDRESS=http://head:8265 deploy/submit.sh --input s3://corpus/fineweb/ --output s3://groups/ [--set ...]
# The cluster's image must have pairmine installed (docker/Dockerfile); inside the job, pairmine connects to the
# cluster through RAY_ADDRESS, which Ray sets for job drivers.
set -euo pipefail
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the Ray cluster, e.g. http://ray-head:8265}"
exec ray job submit --address "$RAY_ADDRESS" -- pairmine mine "$@"
