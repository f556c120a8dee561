#!/usr/bin/env bash
# Checks that a libqjlkv shared library exports exactly the functions the public header
# declares with QJLKV_API: nothing else leaks (no C++ runtime, no internal symbols) and
# nothing declared is missing.
# Usage: tests/packaging/check_exports.sh LIBQJLKV_SO [HEADER]   (default: include/qjlkv/qjlkv.h)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
lib=${1:?usage: check_exports.sh LIBQJLKV_SO [HEADER]}
header=${2:-$repo/include/qjlkv/qjlkv.h}

# Declarations may span lines: join the header, then take the name before each "(".
declared=$(tr '\n' ' ' <"$header" | grep -o 'QJLKV_API[^;(]*(' | grep -o 'qjlkv_[A-Za-z0-9_]*[[:space:]]*($' |
  tr -d '( \t' | sort -u)
# The version nodes of src/qjlkv.map appear as absolute symbols named after them (QJLKV_0.1).
exported=$(nm -D --defined-only "$lib" | awk '{print $NF}' | grep -v '^QJLKV_[0-9.]*$' | sed 's/@.*//' | sort -u)
unversioned=$(nm -D --defined-only "$lib" | awk '{print $NF}' | grep '^qjlkv_' | grep -v '@@QJLKV_[0-9.]*$' || true)

status=0
if [[ -n $unversioned ]]; then
  echo "check_exports: $lib exports functions without a version node (src/qjlkv.map):" >&2
  sed 's/^/  /' <<<"$unversioned" >&2
  status=1
fi
if [[ -z $declared ]]; then
  echo "check_exports: no QJLKV_API declarations found in $header" >&2
  exit 1
fi
foreign=$(grep -v '^qjlkv_' <<<"$exported" || true)
if [[ -n $foreign ]]; then
  echo "check_exports: $lib exports symbols outside the qjlkv_ namespace:" >&2
  sed 's/^/  /' <<<"$foreign" >&2
  status=1
fi
undeclared=$(comm -13 <(echo "$declared") <(grep '^qjlkv_' <<<"$exported" || true))
if [[ -n $undeclared ]]; then
  echo "check_exports: $lib exports qjlkv_ symbols the header does not declare:" >&2
  sed 's/^/  /' <<<"$undeclared" >&2
  status=1
fi
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
if [[ -n $missing ]]; then
  echo "check_exports: functions declared QJLKV_API but not exported by $lib:" >&2
  sed 's/^/  /' <<<"$missing" >&2
  status=1
fi
if [[ $status == 0 ]]; then
  echo "check_exports: $(wc -l <<<"$declared") functions, exactly the header's QJLKV_API set"
fi
exit $status
