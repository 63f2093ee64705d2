#!/usr/bin/env bash
# check_symbols.sh BUILD - libmok as a library: libmok.so exports exactly the
# functions mok.h and mok_errno.h declare (no protobuf-c, framing or internal
# helper leaks), carries the soname libmok.so.MAJOR, is installed under its
# real name with the two links, and mok_version() says the header's version.
set -euo pipefail
build=${1:?usage: check_symbols.sh BUILD}
hdr=(client/include/mok.h client/include/mok_errno.h)
fail() { echo "check_symbols: $*" >&2; exit 1; }

ver() { sed -n "s/^#define MOK_VERSION_$1 \([0-9]*\)$/\1/p" client/include/mok.h; }
major=$(ver MAJOR)
version=$major.$(ver MINOR).$(ver PATCH)
real=$build/libmok.so.$version

if [ ! -f "$real" ] || [ -L "$real" ]; then fail "$real is not a real file"; fi
[ "$(readlink "$build/libmok.so.$major")" = "libmok.so.$version" ] ||
  fail "$build/libmok.so.$major does not point at libmok.so.$version"
[ "$(readlink "$build/libmok.so")" = "libmok.so.$major" ] ||
  fail "$build/libmok.so does not point at libmok.so.$major"
soname=$(objdump -p "$real" | awk '$1 == "SONAME" {print $2}')
[ "$soname" = "libmok.so.$major" ] || fail "soname is '$soname', not libmok.so.$major"

# defined dynamic symbols, less the version node (type A) and @VERSION tails
exported=$(nm -D --defined-only "$real" | awk '$2 != "A" {sub(/@.*/, "", $3); print $3}' | sort -u)
declared=$(grep -ohE '\bmok_[a-z0-9_]+ *\(' "${hdr[@]}" | tr -d ' (' | sort -u)
stray=$(comm -23 <(echo "$exported") <(echo "$declared"))
[ -z "$stray" ] || fail "libmok.so exports symbols no public header declares:" "$stray"
missing=$(comm -13 <(echo "$exported") <(echo "$declared"))
[ -z "$missing" ] || fail "declared in mok.h but not exported:" "$missing"
echo "$exported" | grep -qv '^mok_' && fail "a symbol without the mok_ prefix is exported"

# an ASan build's library needs its runtime loaded first in the interpreter
preload=$(ldd "$real" | awk '/libasan|libubsan/ {printf "%s%s", sep, $3; sep=":"}')
got=$(LD_PRELOAD=$preload ASAN_OPTIONS=detect_leaks=0 python3 -c 'import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.mok_version.restype = ctypes.c_char_p
a, b, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
s = lib.mok_version(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c)).decode()
print(s, "%d.%d.%d" % (a.value, b.value, c.value))' "$build/libmok.so")
[ "$got" = "$version $version" ] || fail "mok_version() says '$got', want '$version $version'"
echo "check_symbols: libmok.so.$version exports $(echo "$exported" | wc -l) mok_ functions," \
  "soname libmok.so.$major, mok_version() $version"
