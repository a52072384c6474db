#!/bin/sh
# Compose (and Docker) secrets arrive as files in /run/secrets, while the services read their settings
# from the environment: export each file named like a variable (RAGSTREAM_API_KEYS,
# RAGSTREAM_CREDENTIAL_KEYS, DATABASE_URL...) as that variable, then run the command. Kubernetes passes
# its Secret as variables already (envFrom); its service-account folder there is not a variable name.
set -eu
secrets="${RAGSTREAM_SECRETS_DIR:-/run/secrets}"
if [ -d "$secrets" ]; then
  for secret in "$secrets"/*; do
    [ -f "$secret" ] || continue
    name=$(basename "$secret")
    case "$name" in
      *[!A-Z0-9_]* | [0-9]*) continue ;;
    esac
    value=$(cat "$secret")
    export "$name=$value"
  done
fi
exec "$@"
