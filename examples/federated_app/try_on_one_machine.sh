#!/usr/bin/env bash
# Try the consortium on one machine: a SuperLink, three synthetic hospitals (one SuperNode each), a two-round run.
# Run it from any folder after `pip install -e ".[federated]"` in the repository root:
#     bash examples/federated_app/try_on_one_machine.sh
# It writes everything under ./consortium-drill (Flower's home, the logs, the data, the report, the model) and stops
# the processes it started when it ends. Ports: LINK_PORT (the SuperLink) and NODE_PORTS (one per SuperNode); ROUNDS.
set -euo pipefail
APP="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LINK_PORT="${LINK_PORT:-9092}"
ROUNDS="${ROUNDS:-2}"  # the drill's rounds (the noise is calibrated so that they end at ε = 4)
read -r PORT_A PORT_B PORT_C <<< "${NODE_PORTS:-9094 9095 9096}"  # three SuperNodes on one machine: three ports
mkdir -p consortium-drill && cd consortium-drill
export FLWR_HOME="$PWD/flwr-home"  # Flower's own folder for this drill (apps, runtime files, config.toml)
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "drill"

[superlink.drill]
address = "127.0.0.1:$LINK_PORT"
insecure = true
TOML

# The consortium's id key: each hospital holds a copy (handed over outside the run); the server never does.
python -c "import secrets; print(secrets.token_hex(32))" > consortium.key
chmod 600 consortium.key

PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait' EXIT
# The coordinator. Its working folder is where the run's outputs land (report, model, checkpoint, TensorBoard).
flower-superlink --insecure --port "$LINK_PORT" --disable-runtime-dependency-installation > superlink.log 2>&1 &
PIDS+=($!)
# Three hospitals: their own port, name, site style, seed (distinct patients) and a copy of the id key.
flower-supernode --insecure --superlink "127.0.0.1:$LINK_PORT" --port "$PORT_A" \
    --node-config "site=\"a\" style=\"reference\" seed=1 patients=20 id-key-file=\"$PWD/consortium.key\"" \
    > supernode-a.log 2>&1 &
PIDS+=($!)
flower-supernode --insecure --superlink "127.0.0.1:$LINK_PORT" --port "$PORT_B" \
    --node-config "site=\"b\" style=\"hospital_b\" seed=2 patients=20 id-key-file=\"$PWD/consortium.key\"" \
    > supernode-b.log 2>&1 &
PIDS+=($!)
flower-supernode --insecure --superlink "127.0.0.1:$LINK_PORT" --port "$PORT_C" \
    --node-config "site=\"c\" style=\"hospital_c\" seed=3 patients=20 id-key-file=\"$PWD/consortium.key\"" \
    > supernode-c.log 2>&1 &
PIDS+=($!)
for _ in $(seq 120); do  # wait (at most 60 s) until the SuperLink listens
    (exec 3<> "/dev/tcp/127.0.0.1/$LINK_PORT") 2> /dev/null && break
    sleep 0.5
done

# The run: N = 60 declared (3 × 20), ε = 4 after the rounds of this drill. Each round prints ε and the noise std.
flwr run "$APP" drill --stream --run-config "rounds=$ROUNDS"
cat federated/privacy_report.json
echo "The model: $PWD/federated/model.pt; the hospitals' logs: $PWD/supernode-*.log"
