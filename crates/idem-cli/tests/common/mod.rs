//! What several test files share: a NATS server of the test's own, on a free port, that a test may kill and
//! start again (the shared server is never touched).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A NATS server of the test's own, on a free port with its own store, so it can be stopped and started again.
pub struct OwnNatsServer {
    port: u16,
    store: PathBuf,
    child: Option<Child>,
}

impl OwnNatsServer {
    pub fn start() -> OwnNatsServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let store = std::env::temp_dir().join(format!("idem-nats-{}-{port}", std::process::id()));
        let mut server = OwnNatsServer { port, store, child: None };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) and waits until it accepts connections.
    pub fn restart(&mut self) {
        let binary = std::env::var("IDEM_NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".to_owned());
        let port = self.port.to_string();
        let store = self.store.display().to_string();
        let child = Command::new(&binary)
            .args(["-a", "127.0.0.1", "-p", &port, "-js", "-sd", &store])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {binary} (set IDEM_NATS_SERVER): {e}"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "the test's nats-server did not start on port {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for OwnNatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}
