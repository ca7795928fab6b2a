# Shared by the agent bench scripts (sourced): the bench settings they price with, and the remote.

# bench_toml FILE MAX_TOKENS: the bench TOML, at the prices of a frontier MoE API with prefix
# caching, and a laptop.
bench_toml() {
  cat > "$1" <<TOML
max_tokens = $2
agree_at = 0.5
[cost]
input_per_mtok = 0.60
cached_input_per_mtok = 0.15
output_per_mtok = 2.50
hardware_per_hour = 0.05
watts = 30.0
per_kwh = 0.30
TOML
}

# serve_remote K3MINI DIR: SmolLM2-135M-Instruct behind `teacher serve` on a free port, stopped when
# the script exits; sets URL (its log is DIR/teacher.log).
serve_remote() {
  "$1" teacher serve smollm2 --port 0 > "$2/teacher.log" 2>&1 &
  TEACHER=$!
  trap 'kill $TEACHER 2>/dev/null' EXIT
  for _ in $(seq 100); do grep -q "^listening on" "$2/teacher.log" && break; sleep 0.2; done
  URL=$(awk '/^listening on/ {print $3; exit}' "$2/teacher.log")
  [ -n "$URL" ] || { cat "$2/teacher.log"; exit 1; }
}
