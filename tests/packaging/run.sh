#!/usr/bin/env bash
# Packaging tests: installs a build of libqjlkv to a temporary prefix and proves that an
# engine can use it. Layout, SONAME and symlinks, exported symbols, the ABI against the
# committed baseline, pkg-config consumers (C shared and static, C++), the CMake package
# (shared, static and C++ consumers, a C-only project, version compatibility), relocation
# of the whole prefix to another directory, and the CPack .tar.gz and .deb contents.
#
# Usage: tests/packaging/run.sh BUILD_DIR   (a configured and built tree of this repository)
# Needs cmake, cpack, pkg-config, cc, c++, readelf, nm, tar, dpkg-deb, abigail-tools.
# Ends with "packaging: N passed, M failed"; the exit status is 0 only when M is 0.
# pkg-config prints lists of flags; they are split on purpose, as make does.
# shellcheck disable=SC2046
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
if [[ $# != 1 || ! -f $1/CMakeCache.txt ]]; then
  echo "usage: tests/packaging/run.sh BUILD_DIR (a configured and built CMake tree)" >&2
  exit 2
fi
build=$(cd "$1" && pwd)

header=$repo/include/qjlkv/qjlkv.h
version_part() { sed -n "s/^#define QJLKV_VERSION_$1 \([0-9]*\).*/\1/p" "$header"; }
major=$(version_part MAJOR)
minor=$(version_part MINOR)
version=$major.$minor.$(version_part PATCH)
libdir=$(sed -n 's/^CMAKE_INSTALL_LIBDIR:[A-Z]*=//p' "$build/CMakeCache.txt")
libdir=${libdir:-lib}

work=$(mktemp -d "${TMPDIR:-/tmp}/qjlkv-packaging.XXXXXX")
trap 'rm -rf "$work"' EXIT
jobs=$(nproc)

passed=0
failed=0
# check NAME COMMAND...: runs one test in a subshell with its output in a log, shown when it
# fails. Test steps end in `|| fail MESSAGE` or `|| exit 1`: fail leaves the subshell.
check() {
  local name=$1
  shift
  if ("$@") >"$work/log" 2>&1; then
    passed=$((passed + 1))
    echo "PASS $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name"
    tail -n 40 "$work/log" | sed 's/^/     /'
    return 1
  fi
}
finish() {
  echo "packaging: $passed passed, $failed failed"
  exit $((failed > 0))
}
fail() {
  echo "$*" >&2
  exit 1
}

# ---------------------------------------------------------------------------
# The installed tree
# ---------------------------------------------------------------------------
# Every file and link an install holds, relative to the prefix; the build type's name in
# qjlkvTargets-<config>.cmake is left open.
expected_files() {
  printf '%s\n' include/qjlkv/qjlkv.h \
    "$libdir/libqjlkv.so.$version" "$libdir/libqjlkv.so.$major" "$libdir/libqjlkv.so" "$libdir/libqjlkv.a" \
    "$libdir/pkgconfig/qjlkv.pc" \
    "$libdir/cmake/qjlkv/qjlkvConfig.cmake" "$libdir/cmake/qjlkv/qjlkvConfigVersion.cmake" \
    "$libdir/cmake/qjlkv/qjlkvTargets.cmake" "$libdir/cmake/qjlkv/qjlkvTargets-<config>.cmake" | sort
}
# same_files: the file list on stdin (relative paths) is exactly expected_files.
same_files() {
  local actual
  actual=$(sed 's|qjlkvTargets-[a-z]*\.cmake$|qjlkvTargets-<config>.cmake|' | sort)
  if [[ $actual != "$(expected_files)" ]]; then
    diff <(expected_files) <(echo "$actual") | sed 's/^/  (< expected, > found) /'
    fail "the file list differs"
  fi
}

install_to() { cmake --install "$build" --prefix "$1" || exit 1; }
layout() { (cd "$1" && find . ! -type d | sed 's|^\./||') | same_files || exit 1; }

soname_and_links() {
  local dir=$1/$libdir
  [[ -f $dir/libqjlkv.so.$version && ! -L $dir/libqjlkv.so.$version ]] || fail "libqjlkv.so.$version is not a file"
  [[ $(readlink "$dir/libqjlkv.so.$major") == "libqjlkv.so.$version" ]] ||
    fail "libqjlkv.so.$major -> $(readlink "$dir/libqjlkv.so.$major"), expected libqjlkv.so.$version"
  [[ $(readlink "$dir/libqjlkv.so") == "libqjlkv.so.$major" ]] ||
    fail "libqjlkv.so -> $(readlink "$dir/libqjlkv.so"), expected libqjlkv.so.$major"
  local dynamic
  dynamic=$(readelf -d "$dir/libqjlkv.so.$version") || exit 1
  grep -q "(SONAME) *Library soname: \[libqjlkv.so.$major\]" <<<"$dynamic" ||
    fail "SONAME is not libqjlkv.so.$major: $(grep SONAME <<<"$dynamic")"
  ! grep -E 'R(UN)?PATH' <<<"$dynamic" || fail "the installed library carries a run path"
}

# No file of the tree names the directory it was installed to.
no_absolute_prefix() {
  local hits
  hits=$(grep -rl -- "$1" "$1" || true)
  [[ -z $hits ]] || fail "these files hold the install prefix $1:" $'\n'"$hits"
}

# ---------------------------------------------------------------------------
# Consumers
# ---------------------------------------------------------------------------
c_flags=(-std=c99 -Wall -Wextra -Werror -pedantic)
cxx_flags=(-std=c++17 -Wall -Wextra -Werror -pedantic)

# needs_shared BINARY yes|no: whether BINARY loads libqjlkv.so.<major>.
needs_shared() {
  local needed
  needed=$(readelf -d "$1" | grep NEEDED) || fail "readelf -d $1 failed"
  if [[ $2 == yes ]]; then
    grep -q "\[libqjlkv.so.$major\]" <<<"$needed" || fail "$1 does not load libqjlkv.so.$major"
  else
    ! grep -q libqjlkv <<<"$needed" || fail "$1 loads libqjlkv dynamically: $needed"
  fi
}

# pc_* PREFIX OUTDIR: build a consumer with nothing but `pkg-config qjlkv` from PREFIX, run it.
pc_env() { PKG_CONFIG_PATH="$1/$libdir/pkgconfig" PKG_CONFIG_LIBDIR="$1/$libdir/pkgconfig" pkg-config "${@:2}"; }
pc_metadata() {
  [[ $(pc_env "$1" --modversion qjlkv) == "$version" ]] || fail "pkg-config version $(pc_env "$1" --modversion qjlkv)"
  [[ $(realpath "$(pc_env "$1" --variable=libdir qjlkv)") == "$(realpath "$1/$libdir")" ]] ||
    fail "pkg-config libdir $(pc_env "$1" --variable=libdir qjlkv) is not under $1"
  [[ $(realpath "$(pc_env "$1" --variable=includedir qjlkv)") == "$(realpath "$1/include")" ]] ||
    fail "pkg-config includedir $(pc_env "$1" --variable=includedir qjlkv) is not under $1"
}
pc_c_shared() {
  local libs
  libs=$(pc_env "$1" --libs qjlkv) || exit 1
  cc "${c_flags[@]}" -DCONSUMER_NAME='"pkg-config, shared"' $(pc_env "$1" --cflags qjlkv) \
    "$here/consumer/consumer.c" -o "$2/c_shared" $libs -lm -Wl,-rpath,"$(pc_env "$1" --variable=libdir qjlkv)" ||
    exit 1
  needs_shared "$2/c_shared" yes
  "$2/c_shared" || exit 1
}
pc_c_static() {
  # --static adds Libs.private (the C++ runtime, threads); -l:libqjlkv.a picks the archive.
  local libs
  libs=$(pc_env "$1" --static --libs qjlkv) || exit 1
  libs=${libs/-lqjlkv/-l:libqjlkv.a}
  cc "${c_flags[@]}" -DCONSUMER_NAME='"pkg-config, static"' $(pc_env "$1" --cflags qjlkv) \
    "$here/consumer/consumer.c" -o "$2/c_static" $libs -lm || exit 1
  needs_shared "$2/c_static" no
  "$2/c_static" || exit 1
}
pc_cxx_shared() {
  c++ "${cxx_flags[@]}" $(pc_env "$1" --cflags qjlkv) "$here/consumer/consumer.cpp" -o "$2/cxx_shared" \
    $(pc_env "$1" --libs qjlkv) -Wl,-rpath,"$(pc_env "$1" --variable=libdir qjlkv)" || exit 1
  needs_shared "$2/cxx_shared" yes
  "$2/cxx_shared" || exit 1
}

# cmake_configure PREFIX BUILD_DIR [ARGS...]: the consumer project, finding qjlkv in PREFIX only.
cmake_configure() {
  local search=$1
  # find_package looks in <prefix>/lib*/cmake only where the platform uses lib64 (not Debian)
  [[ $libdir == lib ]] || search="$1;$1/$libdir/cmake/qjlkv"
  cmake -S "$here/cmake_consumer" -B "$2" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$search" \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF "${@:3}"
}
# cmake_consumers PREFIX BUILD_DIR [ARGS...]: configure, build and run every consumer executable.
cmake_consumers() {
  cmake_configure "$@" || exit 1
  local found
  found=$(sed -n 's/^qjlkv_DIR:[A-Z]*=//p' "$2/CMakeCache.txt")
  [[ $(realpath "$found") == "$(realpath "$1/$libdir/cmake/qjlkv")" ]] || fail "found qjlkv in $found, not in $1"
  cmake --build "$2" -j "$jobs" || exit 1
  needs_shared "$2/consumer_shared" yes
  needs_shared "$2/consumer_static" no
  "$2/consumer_shared" || exit 1
  "$2/consumer_static" || exit 1
  if grep -q '^CONSUMER_CXX:BOOL=ON$' "$2/CMakeCache.txt"; then
    "$2/consumer_cxx" || exit 1
  fi
}
# A newer MINOR or the next MAJOR must be refused (SameMajorVersion: one SONAME per MAJOR).
cmake_version_refused() {
  local wanted
  mkdir -p "$2" || exit 1
  for wanted in "$major.$((minor + 1))" "$((major + 1)).0"; do
    if cmake_configure "$1" "$2/v$wanted" -DCONSUMER_QJLKV_VERSION="$wanted" >"$2/v$wanted.log" 2>&1; then
      fail "find_package(qjlkv $wanted) accepted version $version"
    fi
    grep -q "with requested version \"$wanted\"" "$2/v$wanted.log" &&
      grep -q "qjlkvConfig.cmake, version: $version" "$2/v$wanted.log" ||
      { cat "$2/v$wanted.log"; fail "find_package(qjlkv $wanted) failed for another reason"; }
  done
}

# ---------------------------------------------------------------------------
# Packages
# ---------------------------------------------------------------------------
# cpack_make GENERATOR: one package in $work/packages, printed.
cpack_make() {
  cpack --config "$build/CPackConfig.cmake" -G "$1" -B "$work/packages" >"$work/cpack-$1.log" 2>&1 ||
    { cat "$work/cpack-$1.log"; fail "cpack -G $1 failed"; }
}
tgz_contents() {
  cpack_make TGZ
  local archive
  archive=$(find "$work/packages" -maxdepth 1 -name '*.tar.gz')
  [[ $(wc -l <<<"$archive") == 1 && -n $archive ]] || fail "expected one .tar.gz, got: $archive"
  echo "$(basename "$archive"):"
  # one top directory named like the archive, holding the prefix
  local top
  top=$(basename "$archive" .tar.gz)
  tar tzf "$archive" | grep -v "^$top/" && fail "entries outside $top/"
  tar tzf "$archive" | grep -v '/$' | sed "s|^$top/||" | same_files || exit 1
  rm -rf "$work/tgzroot" && mkdir "$work/tgzroot" && tar xzf "$archive" -C "$work/tgzroot" || fail "tar xzf failed"
  mv "$work/tgzroot/$top" "$work/tgzroot/prefix" || exit 1
}
deb_contents() {
  cpack_make DEB
  local deb
  deb=$(find "$work/packages" -maxdepth 1 -name '*.deb')
  [[ $(wc -l <<<"$deb") == 1 && -n $deb ]] || fail "expected one .deb, got: $deb"
  echo "$(basename "$deb"):"
  dpkg-deb --fsys-tarfile "$deb" | tar t | grep -v '/$' | sed 's|^\./usr/||' | same_files || exit 1
  [[ $(dpkg-deb -f "$deb" Package) == libqjlkv && $(dpkg-deb -f "$deb" Version) == "$version" ]] ||
    fail "control: $(dpkg-deb -f "$deb" Package Version)"
  grep -q libstdc++6 <<<"$(dpkg-deb -f "$deb" Depends)" || fail "Depends lacks libstdc++6: $(dpkg-deb -f "$deb" Depends)"
  rm -rf "$work/debroot" && dpkg-deb -x "$deb" "$work/debroot" || fail "dpkg-deb -x failed"
}

# ---------------------------------------------------------------------------
prefix=$work/install
out=$work/bin
mkdir -p "$out"

check "install to a fresh prefix" install_to "$prefix" || finish
check "layout: exactly the library, header, .pc and CMake files" layout "$prefix"
check "SONAME libqjlkv.so.$major, symlinks, no run path" soname_and_links "$prefix"
check "exported symbols: exactly the header's QJLKV_API functions" \
  "$here/check_exports.sh" "$prefix/$libdir/libqjlkv.so.$version" "$prefix/include/qjlkv/qjlkv.h"
check "ABI equals abi/libqjlkv.abi (own -g build)" "$here/abi_check.sh"
check "no file holds the install prefix" no_absolute_prefix "$prefix"
check "pkg-config: version, libdir and includedir from \${pcfiledir}" pc_metadata "$prefix"
check "pkg-config: C99 consumer, shared" pc_c_shared "$prefix" "$out"
check "pkg-config: C99 consumer, static (Libs.private)" pc_c_static "$prefix" "$out"
check "pkg-config: C++ consumer, shared" pc_cxx_shared "$prefix" "$out"
check "find_package: qjlkv::qjlkv, qjlkv::qjlkv_static, C++ consumer" cmake_consumers "$prefix" "$work/cmake"
check "find_package: C-only project links qjlkv::qjlkv_static" \
  cmake_consumers "$prefix" "$work/cmake-c" -DCONSUMER_CXX=OFF
check "find_package: newer MINOR and next MAJOR refused" cmake_version_refused "$prefix" "$work/cmake-versions"

# Relocation: move the whole prefix elsewhere (another depth too), then consume it again.
moved=$work/elsewhere/deeper/qjlkv
mkdir -p "$(dirname "$moved")" && mv "$prefix" "$moved"
check "relocated: pkg-config paths follow the moved prefix" pc_metadata "$moved"
check "relocated: pkg-config C99 consumer, shared" pc_c_shared "$moved" "$out"
check "relocated: pkg-config C99 consumer, static" pc_c_static "$moved" "$out"
check "relocated: find_package consumers" cmake_consumers "$moved" "$work/cmake-moved"

if check "cpack TGZ: exactly the installed files" tgz_contents; then
  check "cpack TGZ: C99 consumer against the unpacked archive" pc_c_static "$work/tgzroot/prefix" "$out"
fi
if check "cpack DEB: exactly the installed files under /usr, control fields" deb_contents; then
  check "cpack DEB: C99 consumer against the unpacked package" pc_c_shared "$work/debroot/usr" "$out"
fi
finish
