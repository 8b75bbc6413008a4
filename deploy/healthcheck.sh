#!/bin/bash
# Container health check: GET /readyz on HOST PORT with bash alone (the runtime image has no
# curl); healthy only on "200".
set -eu
exec 3<>"/dev/tcp/${1:-127.0.0.1}/${2:-8080}"
printf 'GET /readyz HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' "${1:-127.0.0.1}" >&3
read -r -t 3 _ status _ <&3
[ "$status" = "200" ]
