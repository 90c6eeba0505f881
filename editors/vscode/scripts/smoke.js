// Talk to `meshc lsp` with vscode-jsonrpc, the JSON-RPC library inside vscode-languageclient: start
// the server, initialize, open a .mesh file, print its diagnostics and a hover as JSON, shut down.
//   node scripts/smoke.js FILE LINE CHARACTER [meshc lsp command...]
const cp = require("child_process");
const fs = require("fs");
const path = require("path");
const url = require("url");
const rpc = require("vscode-jsonrpc/node");

const [file, line, character, ...cmd] = process.argv.slice(2);
const command = cmd.length ? cmd : ["meshc", "lsp"];
const proc = cp.spawn(command[0], command.slice(1), { stdio: ["pipe", "pipe", "inherit"] });
const conn = rpc.createMessageConnection(new rpc.StreamMessageReader(proc.stdout), new rpc.StreamMessageWriter(proc.stdin));
const uri = url.pathToFileURL(path.resolve(file)).href;

conn.onNotification("textDocument/publishDiagnostics", async (params) => {
  if (params.uri !== uri) return;
  const hover = await conn.sendRequest("textDocument/hover", {
    textDocument: { uri },
    position: { line: Number(line), character: Number(character) },
  });
  process.stdout.write(JSON.stringify({ diagnostics: params.diagnostics, hover }));
  await conn.sendRequest("shutdown");
  conn.sendNotification("exit");
  setTimeout(() => process.exit(0), 200);
});
conn.listen();
conn
  .sendRequest("initialize", { processId: process.pid, rootUri: null, capabilities: {} })
  .then(() => {
    conn.sendNotification("initialized", {});
    conn.sendNotification("textDocument/didOpen", {
      textDocument: { uri, languageId: "mesh", version: 1, text: fs.readFileSync(file, "utf8") },
    });
  });
setTimeout(() => {
  console.error("no answer from the server in 60 s");
  process.exit(1);
}, 60000);
