#!/bin/sh
# forewarn Slurm prolog: run `forewarn check` before the job starts on this node.
# On an unhealthy GPU it drains the node with the check's reason (scontrol) and exits 1,
# so Slurm requeues the job on another node. Configure with slurm.conf's Prolog= (and
# Epilog= for epilog.sh). Settings, optional, in /etc/forewarn/slurm.env (sh syntax):
#   FOREWARN=/usr/local/bin/forewarn     the forewarn command
#   FOREWARN_CHECK_ARGS="--config /etc/forewarn/agent.toml"   extra `forewarn check` flags
#   FOREWARN_DRAIN_ON_ERROR=0            1: also drain when the check cannot run (exit 2)
#   SCONTROL=scontrol                    the scontrol command
# Exit 2 of the check (it could not run: no driver, bad config) lets the job start unless
# FOREWARN_DRAIN_ON_ERROR=1: a broken preflight must not stop the whole cluster.
set -u
conf=${FOREWARN_SLURM_ENV:-/etc/forewarn/slurm.env}
# shellcheck disable=SC1090
[ -r "$conf" ] && . "$conf"
PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin:$PATH
FOREWARN=${FOREWARN:-forewarn}
SCONTROL=${SCONTROL:-scontrol}
context=${FOREWARN_CONTEXT:-prolog}
node=${SLURMD_NODENAME:-$(hostname -s)}

set -f  # FOREWARN_CHECK_ARGS is split on spaces, never globbed
# shellcheck disable=SC2086
out=$("$FOREWARN" check ${FOREWARN_CHECK_ARGS:-} 2>&1)
rc=$?
set +f
printf '%s\n' "$out"
case $rc in
  0) exit 0 ;;
  1) ;;
  *) [ "${FOREWARN_DRAIN_ON_ERROR:-0}" = 1 ] || exit 0 ;;
esac
# The first line that is not "ok": which check, which GPU, why. scontrol gets it as one
# argument (no shell), cut to 200 characters.
why=$(printf '%s\n' "$out" | grep -v '^ok ' | head -n 1 | tr -s ' ' | cut -c1-200)
"$SCONTROL" update "nodename=$node" state=drain "reason=forewarn $context: $why"
[ "$context" = epilog ] && exit 0  # the job is over: draining is enough
exit 1
