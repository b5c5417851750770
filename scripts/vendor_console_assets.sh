#!/usr/bin/env bash
# Vendor the admin console's third-party browser assets from the npm registry into
# gateway/console/static/vendor/. Run by a maintainer when bumping a version; the copied
# files are committed, so installing the package never needs Node.
#
#   scripts/vendor_console_assets.sh            # the pinned versions below
#   HTMX_VERSION=2.0.11 UPLOT_VERSION=1.6.32 scripts/vendor_console_assets.sh
#
# Needs: npm (Node >= 18). Uses `npm pack` (a tarball per package, no dependency tree,
# no install scripts run) in a temporary directory that is removed on exit.
set -euo pipefail

HTMX_VERSION="${HTMX_VERSION:-2.0.11}"
UPLOT_VERSION="${UPLOT_VERSION:-1.6.32}"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/gateway/console/static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd "$work"
npm pack --silent "htmx.org@${HTMX_VERSION}" "uplot@${UPLOT_VERSION}" >/dev/null
mkdir htmx uplot
tar -xzf "htmx.org-${HTMX_VERSION}.tgz" -C htmx
tar -xzf "uplot-${UPLOT_VERSION}.tgz" -C uplot

mkdir -p "$dest"
cp htmx/package/dist/htmx.min.js "$dest/htmx.min.js"
cp htmx/package/LICENSE "$dest/htmx.LICENSE.txt"
cp uplot/package/dist/uPlot.iife.min.js "$dest/uPlot.iife.min.js"
cp uplot/package/dist/uPlot.min.css "$dest/uPlot.min.css"
cp uplot/package/LICENSE "$dest/uPlot.LICENSE.txt"
cat > "$dest/VERSIONS.txt" <<EOF
htmx.org ${HTMX_VERSION} (dist/htmx.min.js, 0BSD, see htmx.LICENSE.txt)
uplot ${UPLOT_VERSION} (dist/uPlot.iife.min.js, dist/uPlot.min.css, MIT, see uPlot.LICENSE.txt)
Vendored by scripts/vendor_console_assets.sh from the npm registry.
EOF
echo "vendored htmx ${HTMX_VERSION} and uPlot ${UPLOT_VERSION} into ${dest#"$root"/}"
