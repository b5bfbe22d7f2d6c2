#!/usr/bin/env bash
# A throwaway PostgreSQL server for the store tests: its own data directory, a free loopback port,
# started as the postgres user (PostgreSQL refuses to run as root).
#   postgres_server.sh available      exit 0 if the server binaries are installed, else say "skipped: ..."
#   postgres_server.sh start DIR      init + start; prints the connection URL (postgresql://...) on stdout
#   postgres_server.sh restart DIR    fast shutdown and start again, as an operator's `pg_ctl restart` (clients are cut off)
#   postgres_server.sh away DIR SECS  stopped for SECS seconds, then started again on the same port (an outage)
#   postgres_server.sh stop DIR       stop it (fast shutdown); fine if it is not running
set -euo pipefail

bin_dir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && { echo "$d"; return 0; }
  done
  return 1
}

# Run a command as the postgres user when we are root; as ourselves otherwise.
as_owner() {
  if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()' 2>/dev/null ||
    echo $((20000 + RANDOM % 20000))
}

cmd=${1:-}
case "$cmd" in
  available)
    if ! bin_dir >/dev/null; then
      echo "skipped: no PostgreSQL server (initdb, pg_ctl) installed (./setup.sh --with-test-tools installs it)"
      exit 1
    fi
    if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1; then
      echo "skipped: no postgres user to run the server as"
      exit 1
    fi
    ;;
  start)
    dir=${2:?usage: postgres_server.sh start DIR}
    bin=$(bin_dir) || { echo "postgres_server.sh: no PostgreSQL server installed" >&2; exit 1; }
    mkdir -p "$dir"
    if [ "$(id -u)" -eq 0 ]; then
      chown postgres "$dir"
      chmod o+x "$(dirname "$dir")"  # a mkdtemp parent is 0700: the postgres user must pass through it
    fi
    chmod 700 "$dir"
    as_owner "$bin/initdb" -D "$dir/data" -U dsrun --auth=trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 ||
      { cat "$dir/initdb.log" >&2; exit 1; }
    port=$(free_port)
    # Sockets in DIR (not /run/postgresql, which may not exist); loopback TCP for the URL.
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 \
      -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=100 -c fsync=off" start >/dev/null ||
      { cat "$dir/server.log" >&2; exit 1; }
    as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U dsrun dsrun
    echo "$port" >"$dir/port"
    echo "postgresql://dsrun@127.0.0.1:$port/dsrun"
    ;;
  restart)
    dir=${2:?usage: postgres_server.sh restart DIR}
    bin=$(bin_dir) || { echo "postgres_server.sh: no PostgreSQL server installed" >&2; exit 1; }
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -m fast -w -t 30 restart >/dev/null ||
      { cat "$dir/server.log" >&2; exit 1; }
    ;;
  away)
    dir=${2:?usage: postgres_server.sh away DIR SECONDS}
    seconds=${3:?usage: postgres_server.sh away DIR SECONDS}
    bin=$(bin_dir) || { echo "postgres_server.sh: no PostgreSQL server installed" >&2; exit 1; }
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    sleep "$seconds"
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 \
      -o "-p $(cat "$dir/port") -k $dir -c listen_addresses=127.0.0.1 -c max_connections=100 -c fsync=off" start >/dev/null ||
      { cat "$dir/server.log" >&2; exit 1; }
    ;;
  stop)
    dir=${2:?usage: postgres_server.sh stop DIR}
    bin=$(bin_dir) || exit 0
    [ -f "$dir/data/postmaster.pid" ] && as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    ;;
  *)
    echo "usage: postgres_server.sh available | start DIR | restart DIR | away DIR SECONDS | stop DIR" >&2
    exit 2
    ;;
esac
