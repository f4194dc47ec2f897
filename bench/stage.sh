# Sourced by the GPU-machine scripts (bench/run-h200.sh,
# bench/cp-split-h200.sh): log and stage, with $LOG the log file and $T0
# the start time (date +%s) set by the script.

# log TEXT...: one line with the seconds since T0, to stdout and the log.
log() { printf '[%4ds] %s\n' "$(($(date +%s) - T0))" "$*" | tee -a "$LOG"; }

# stage NAME SECONDS CMD...: runs CMD under a time limit, appends its output
# to the log, and never stops the script. With STAGE_FILTER set (a
# comma-separated list of names), a stage it does not name is skipped.
stage() {
	local name=$1 secs=$2
	shift 2
	if [ -n "${STAGE_FILTER:-}" ]; then
		case ",$STAGE_FILTER," in *",$name,"*) ;; *) return 0 ;; esac
	fi
	log "== $name (limit ${secs}s): $*"
	timeout --kill-after=10 "$secs" "$@" >>"$LOG" 2>&1
	local rc=$?
	case $rc in
	0) log "== $name: ok" ;;
	124 | 137) log "== $name: STOPPED at its time limit (exit $rc)" ;;
	*) log "== $name: FAILED (exit $rc)" ;;
	esac
	return 0
}
