#!/usr/bin/env bash
# Render a `pairmine report` page in headless Chromium (Debian's `chromium` package: apt-get install -y chromium)
# and save a PNG screenshot of its first WIDTH x HEIGHT pixels. Checks that the page and its plots render in a real
# browser; used to make docs/report-screenshot.png.
#
#   scripts/report_screenshot.sh RUN/report/report.html shot.png [WIDTH] [HEIGHT]
#
# Exit codes: 0 ok, 2 bad arguments or no report, 3 no chromium, 4 chromium ran but wrote no screenshot.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 REPORT_HTML OUT_PNG [WIDTH] [HEIGHT]" >&2
  exit 2
fi
html=$(realpath "$1")
out=$(realpath -m "$2")
width=${3:-1280}
height=${4:-2400}
[ -f "$html" ] || { echo "$0: no such report: $1" >&2; exit 2; }
browser=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
[ -n "$browser" ] || { echo "$0: chromium not found (apt-get install -y chromium, or set CHROMIUM)" >&2; exit 3; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
rm -f "$out"
# Headless, no sandbox (root in containers), no network-facing background work, a fresh throwaway profile.
timeout 120 "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync --hide-scrollbars \
  --user-data-dir="$profile" --window-size="$width,$height" --screenshot="$out" "file://$html" \
  >"$profile/chromium.log" 2>&1 || true
if [ ! -s "$out" ]; then
  echo "$0: chromium wrote no screenshot; its log:" >&2
  tail -20 "$profile/chromium.log" >&2
  exit 4
fi
echo "screenshot: $out (${width}x${height})"
