//! # moelink-testkit
//!
//! What moelink's tests, `moelink bench` and the stress tools (`moelink-stress soak`, `moelink-stress chaos`)
//! share, written once: a seeded generator and the routings drawn from it ([`rng`], [`routing`]), random
//! payloads ([`values`]), the bench's inputs with the results they must produce ([`inputs`]), the
//! comparison of a result against the host backend's ([`differ`]), and the harness that runs one test body
//! on every backend ([`harness`], [`backend_tests!`]).
//!
//! Not published: it depends on `moelink`, and `moelink`'s own tests depend on it (a dev-dependency).

pub mod differ;
pub mod experts;
pub mod harness;
pub mod inputs;
pub mod rng;
pub mod routing;
pub mod values;

pub use rng::Rng;
pub use routing::{route, RouteKind};
