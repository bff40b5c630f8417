# Sourced by the result scripts: refuse a bad environment value in one line (exit 2) before
# anything is synthesized, trained or written.
positive_int() {  # NAME VALUE
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "error: $1=$2; expected a positive integer" >&2; exit 2; }
}
existing_path() {  # NAME VALUE (empty: not given)
  [ -z "$2" ] || [ -e "$2" ] || { echo "error: $1=$2 does not exist; expected a trained run folder or checkpoint" >&2; exit 2; }
}
one_of() {  # NAME VALUE CHOICE...
  local name=$1 value=$2; shift 2
  for choice in "$@"; do [ "$value" = "$choice" ] && return 0; done
  echo "error: $name=$value; expected one of: $*" >&2; exit 2
}
