# kvroute's container image: the release binary on a slim Debian, run as a non-root user.
#
#   docker build -t kvroute .
#   docker run --rm -p 8000:8000 kvroute                      # 4 simulated workers
#   docker run --rm -p 8000:8000 kvroute serve --host 0.0.0.0 --simulated-workers 0 \
#     --worker id=1,url=http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558
#
# The built-in model (kvroute-tiny) is compiled into the binary; mount a tokenizer directory
# and pass --model-path for a real model. crates/kvroute/tests/image.rs checks this file.

# The builder: the workspace's toolchain floor (Cargo.toml's rust-version) or newer.
FROM rust:1.88-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvroute \
 && cp target/release/kvroute /usr/local/bin/kvroute

# The runtime: the binary alone (rustls, a pure-Rust ZMQ, the model compiled in: glibc and
# the CA certificates are all it needs from the system).
FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvroute
COPY --from=build /usr/local/bin/kvroute /usr/local/bin/kvroute
USER 10001:10001
EXPOSE 8000 9002
ENTRYPOINT ["/usr/local/bin/kvroute"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
