// Starts `meshc lsp` (stdio) for .mesh files. Everything the editor shows comes from the server;
// this file only decides how to launch it.
import * as vscode from "vscode";
import { LanguageClient, LanguageClientOptions, ServerOptions, TransportKind } from "vscode-languageclient/node";

let client: LanguageClient | undefined;

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  const config = vscode.workspace.getConfiguration("meshllm");
  const [command, ...args] = config.get<string[]>("server.command", ["meshc", "lsp"]);
  const serverOptions: ServerOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: "file", language: "mesh" }, { scheme: "untitled", language: "mesh" }],
    synchronize: { fileEvents: vscode.workspace.createFileSystemWatcher("**/*.mesh") },
  };
  client = new LanguageClient("meshllm", "meshllm language server", serverOptions, clientOptions);
  context.subscriptions.push(
    vscode.workspace.onDidChangeConfiguration(async (e) => {
      if (e.affectsConfiguration("meshllm.server.command") && client) {
        await client.stop();
        await client.start();
      }
    }),
  );
  try {
    await client.start();
  } catch (err) {
    vscode.window.showErrorMessage(
      `meshllm: could not start \`${[command, ...args].join(" ")}\` (${err}). ` +
        'Install the server with `pip install "meshllm[lsp]"` or set meshllm.server.command.',
    );
  }
}

export async function deactivate(): Promise<void> {
  if (client) {
    await client.stop();
  }
}
