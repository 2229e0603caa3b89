//! One module per subcommand, and what the serving ones share.

pub(crate) mod args;
pub(crate) mod bench;
pub(crate) mod frontend;
pub(crate) mod hash;
pub(crate) mod mocker;
pub(crate) mod register;
pub(crate) mod router;
pub(crate) mod serve;

mod process;

pub(crate) use process::{
    announce, bind, decorated, runtime, scheme, serve_until_signal, shutdown_signal, start_picker,
    started,
};
