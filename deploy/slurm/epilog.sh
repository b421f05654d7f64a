#!/bin/sh
# forewarn Slurm epilog: the same check as prolog.sh after the job ends; on an unhealthy
# GPU the node is drained (reason "forewarn epilog: ...") and the epilog exits 0, so Slurm
# adds no "Epilog error" of its own. Settings: see prolog.sh.
FOREWARN_CONTEXT=epilog
export FOREWARN_CONTEXT
exec "$(dirname "$0")/prolog.sh"
