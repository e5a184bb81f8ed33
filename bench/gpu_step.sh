# Sourced by the GPU scripts that run their steps under one deadline (gpu_levers.sh, gpu_long.sh):
#   step NAME SECONDS COMMAND...
# runs COMMAND under `timeout` for SECONDS or what is left of the script's deadline (T0 + DEADLINE, in seconds),
# skips it when 20 s or less are left, logs it to $R/logs/NAME.log, never stops the next step, and prints how it
# ended and the log's last lines matching STEP_GREP. The script sets R, T0, DEADLINE, STEP_TAG (its name in the
# messages) and STEP_GREP.
step() {
  local name=$1 want=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - T0) ))
  local limit=$(( want < left ? want : left ))
  if [ "$limit" -le 20 ]; then echo "[$STEP_TAG] $name: skipped, deadline"; return; fi
  echo "[$STEP_TAG] $name: start (timeout ${limit}s)"
  timeout -k 10 "$limit" "$@" > "$R/logs/$name.log" 2>&1
  echo "[$STEP_TAG] $name: exit $? after $(( $(date +%s) - T0 )) s"
  grep -h "$STEP_GREP" "$R/logs/$name.log" | tail -8 | cut -c1-240
}
